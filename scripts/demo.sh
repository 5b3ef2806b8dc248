#!/usr/bin/env bash
# Set up, then train a tiny transformer through a real ckptd, kill it, resume it, and compare loss curves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
