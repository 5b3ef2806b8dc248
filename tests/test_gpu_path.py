"""Without a GPU: the GPU benchmarks skip cleanly, and bench_gpu_training.py runs through on a tiny CPU model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _bench(script: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a benchmark of benchmarks/ with args, as a user would; return what it did."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the benchmark measures: scripts/gpu_check.sh runs it")
def test_bench_local_on_cuda_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "local-cuda.json"
    args = ["--device", "cuda", "--size-gib", "0.01", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    run = _bench("bench_local.py", *args)
    assert run.returncode == 0, run.stderr
    assert "CUDA is not available here" in run.stdout and "skipped" in run.stdout
    assert not out.exists()  # nothing measured, nothing written
    assert list(tmp_path.iterdir()) == []


def test_bench_local_refuses_an_unknown_device():
    run = _bench("bench_local.py", "--device", "tpu")
    assert run.returncode == 2 and "invalid choice: 'tpu'" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the benchmark measures: scripts/gpu_check.sh runs it")
def test_bench_gpu_training_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu-training.json"
    run = _bench("bench_gpu_training.py", "--dir", str(tmp_path), "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "CUDA is not available here" in run.stdout and "skipped" in run.stdout
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_bench_gpu_training_runs_through_on_a_tiny_cpu_model(tmp_path, short_tmp):
    # The GPU machine is lent rarely and briefly: the script's own logic is checked here, on the CPU.
    out = tmp_path / "gpu-training.json"
    tiny = ["--layers", "1", "--width", "32", "--heads", "2", "--vocab", "100", "--batch", "2", "--seq", "16"]
    args = [*tiny, "--device", "cpu", "--steps", "4", "--every", "2", "--variants", "ckptd", "ckptd-lazy", "dcp-thread"]
    run = _bench("bench_gpu_training.py", *args, "--dir", str(short_tmp), "--json", str(out), timeout_s=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    windows = {(w["variant"], w["every"]): w for w in result["windows"]}
    assert set(windows) == {("none", 2), ("ckptd", 2), ("ckptd-lazy", 2), ("dcp-thread", 2)}
    assert len(windows[("ckptd", 2)]["stall_s"]) == 2 and len(windows[("dcp-thread", 2)]["stall_s"]) == 2
    assert "first save of a prepared job" in run.stdout and not result["errors"]
    assert list(short_tmp.iterdir()) == []  # the daemon's root and socket, and DCP's files, are gone
