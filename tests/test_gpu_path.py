"""The GPU path where there is no GPU: bench_local.py --device cuda skips cleanly (scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the benchmark measures: scripts/gpu_check.sh runs it")
def test_bench_local_on_cuda_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "local-cuda.json"
    args = ["--device", "cuda", "--size-gib", "0.01", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_local.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "CUDA is not available here" in run.stdout and "skipped" in run.stdout
    assert not out.exists()  # nothing measured, nothing written
    assert list(tmp_path.iterdir()) == []


def test_bench_local_refuses_an_unknown_device():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_local.py"), "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "invalid choice: 'tpu'" in run.stderr
