#!/usr/bin/env bash
# Set up, check the dependency floors, lint, type-check and run every test (real daemons included).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/check_floors.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy ckptd client/ckpt client/ckpt_core
# PyTorch's and Lightning's own checkpoint tests on ckptd (tests/upstream/README.md) run when these name
# checkouts of them: their files are copied in, never committed. Without, tests/upstream collects nothing.
if [ -n "${CKPTD_UPSTREAM_PYTORCH:-}" ] && [ -n "${CKPTD_UPSTREAM_LIGHTNING:-}" ]; then
  scripts/upstream_sources.sh "$CKPTD_UPSTREAM_PYTORCH" "$CKPTD_UPSTREAM_LIGHTNING"
fi
.venv/bin/python -m pytest -q "$@"
