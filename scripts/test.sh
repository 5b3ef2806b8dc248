#!/usr/bin/env bash
# Set up, check the dependency floors, lint, type-check and run every test (real daemons included).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/check_floors.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy ckptd client/ckpt
.venv/bin/python -m pytest -q "$@"
