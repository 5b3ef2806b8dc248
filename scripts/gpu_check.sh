#!/usr/bin/env bash
# What needs a GPU, in one go, under 8 minutes on an H100 (a lent machine's call may run 10): the gpu-marked
# tests, bench_local.py with the state on the GPU, the timeline model's predictions, and bench_gpu_training.py
# (a GPT-style training loop: ckptd eager and lazy against dcp.async_save, beside the model's predictions).
# Each part runs under `timeout` with its own share, so one that hangs cannot eat the others' time:
#   version 15 s, gpu tests 110 s, bench_local 75 s, gpu_timeline 20 s, bench_gpu_training 260 s (480 s in all).
# Results go to $RESULTS (default benchmarks/results): gpu-check.log, local-cuda.json, gpu-timeline.json,
# gpu-training.json (written after each round too, so a part cut short still leaves what it measured).
#
# It runs as a lent GPU machine is: no package registry, no venv, no install of the project. The tree is
# put on PYTHONPATH and the interpreter is $PYTHON, else .venv/bin/python where there is one, else python3.
# The daemon imports zstandard, which such a machine lacks: carry a wheel of it in .whl/, made here with
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl zstandard==0.23.0
# and this script installs it into a temporary directory. Without CUDA every part says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
site=""
trap 'if [ -n "$site" ]; then rm -rf "$site"; fi' EXIT
if ! "$PYTHON" -c 'import zstandard' 2>/dev/null; then
  if ! ls .whl/zstandard-*.whl >/dev/null 2>&1; then
    echo "gpu_check: zstandard is missing and no wheel of it is in .whl/ (see this script's header)" >&2
    exit 2
  fi
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/zstandard-*.whl
fi
export PYTHONPATH="$PWD:$PWD/client:$PWD/benchmarks${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Each part runs whatever the one before did (a GPU machine is lent for minutes: one failing test must not cost
# the benchmarks); the script exits with the first failure's status (124: a part ran out of its time). On a lent
# machine, RESULTS=$OUT brings the log and the JSON back even when the call runs out of time.
rc=0
run() {
  local seconds=$1 status=0 began=$SECONDS
  shift
  echo "== $* (at most ${seconds} s)" | tee -a "$RESULTS/gpu-check.log"
  # SIGTERM first (the benchmarks stop their daemon and remove their files), SIGKILL 15 s later.
  timeout -k 15 "$seconds" "$@" 2>&1 | tee -a "$RESULTS/gpu-check.log" || status=$?
  echo "== exit $status after $((SECONDS - began)) s" | tee -a "$RESULTS/gpu-check.log"
  if [ "$rc" -eq 0 ]; then rc=$status; fi
}
: > "$RESULTS/gpu-check.log"
run 15 "$PYTHON" -c 'import torch; print("torch", torch.__version__, "CUDA:", torch.cuda.is_available() and torch.cuda.get_device_name())'
run 110 "$PYTHON" -m pytest -q -m gpu -rs --durations=15 -p no:cacheprovider tests/client/test_cuda_staging.py tests/client/test_placement.py
run 75 "$PYTHON" benchmarks/bench_local.py --device cuda --size-gib "${GPU_BENCH_GIB:-2}" --repeats 2 \
  --json "$RESULTS/local-cuda.json"
run 20 "$PYTHON" benchmarks/gpu_timeline.py --json "$RESULTS/gpu-timeline.json"
run 260 "$PYTHON" benchmarks/bench_gpu_training.py --budget-s 180 --json "$RESULTS/gpu-training.json"
exit "$rc"
