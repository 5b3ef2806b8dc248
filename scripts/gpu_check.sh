#!/usr/bin/env bash
# What needs a GPU, in one go: the gpu-marked tests and bench_local.py with the state on the GPU.
# Where CUDA is not available both say so and skip (exit 0), and the CPU part still runs:
# bench_local.py on the CPU, small. Results go to benchmarks/results/local-{cuda,cpu}.json.
#   scripts/gpu_check.sh            # GPU_BENCH_GIB=8 scripts/gpu_check.sh for a larger GPU state
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -c 'import torch; print("torch", torch.__version__, "CUDA:", torch.cuda.is_available() and torch.cuda.get_device_name())'
.venv/bin/python -m pytest -q -m gpu -rs
.venv/bin/python benchmarks/bench_local.py --device cuda --size-gib "${GPU_BENCH_GIB:-4}" --repeats 3 \
    --json benchmarks/results/local-cuda.json
.venv/bin/python benchmarks/bench_local.py --size-gib 1 --repeats 3 --json benchmarks/results/local-cpu.json
