#!/usr/bin/env bash
# Copy the upstream test files tests/upstream runs (PyTorch DCP's and Lightning's checkpoint suites) out of
# checkouts of those projects into tests/upstream/{dcp,lightning}/, where git ignores them: this repository
# carries only the adaptation (tests/upstream/**/conftest.py, tests/upstream/site/), never upstream code.
# Usage: scripts/upstream_sources.sh PYTORCH LIGHTNING
#   each a source tree (its root) or a git directory, read at the revision in PYTORCH_REV / LIGHTNING_REV
#   (defaults: v2.13.0 and 2.6.5, the releases nearest the pins; a plain tree is taken as it is).
# Without the files, tests/upstream collects nothing (tests/upstream/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
pytorch=${1:?a PyTorch checkout or git directory}
lightning=${2:?a Lightning checkout or git directory}
PYTORCH_REV=${PYTORCH_REV:-v2.13.0}
LIGHTNING_REV=${LIGHTNING_REV:-2.6.5}

# copy SOURCE REV PATH DEST: PATH of SOURCE (at REV when SOURCE is a git directory) to DEST
copy() {
  mkdir -p "$(dirname "$4")"
  if [ -f "$1/$3" ]; then
    cp "$1/$3" "$4"
  elif git -C "$1" show "$2:$3" >"$4.partial"; then
    mv "$4.partial" "$4"
  else
    rm -f "$4.partial"
    return 1
  fi
}

dcp=test/distributed/checkpoint
for f in test_file_system_checkpoint_cpu.py test_dtensor_checkpoint.py test_format_utils.py e2e/test_e2e_save_and_load.py; do
  copy "$pytorch" "$PYTORCH_REV" "$dcp/$f" "tests/upstream/dcp/$(basename "$f")" || echo "missing: $dcp/$f" >&2
done

lt=tests/tests_pytorch
for f in __init__.py conftest.py \
  helpers/__init__.py helpers/runif.py helpers/utils.py helpers/pipelines.py helpers/datamodules.py \
  helpers/datasets.py helpers/simple_models.py helpers/advanced_models.py helpers/dataloaders.py \
  loops/__init__.py loops/test_loops.py \
  checkpointing/__init__.py checkpointing/test_model_checkpoint.py checkpointing/test_checkpoint_callback_frequency.py \
  checkpointing/test_trainer_checkpoint.py models/__init__.py models/test_restore.py \
  plugins/__init__.py plugins/test_checkpoint_io_plugin.py; do
  copy "$lightning" "$LIGHTNING_REV" "$lt/$f" "tests/upstream/lightning/tests_pytorch/$f" || echo "missing: $lt/$f" >&2
done
