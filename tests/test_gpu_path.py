"""Without a GPU: the GPU benchmarks skip cleanly, and bench_gpu_training.py runs through on a tiny CPU model."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
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
    args = [*tiny, "--device", "cpu", "--rounds", "2", "--steps", "4", "--every", "2", "3"]
    args += ["--variants", "ckptd", "ckptd-lazy", "dcp-thread"]
    run = _bench("bench_gpu_training.py", *args, "--dir", str(short_tmp), "--json", str(out), timeout_s=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["complete"] and not result["judged"] and not result["errors"] and not result["left_out"]
    windows = {(w["round"], w["variant"], w["every"]): w for w in result["windows"]}
    variants = ("none", "ckptd", "ckptd-lazy", "dcp-thread")
    assert set(windows) == {(r, v, e) for r in (0, 1) for v in variants for e in (2, 3)}
    orders = [[v for (r, v, e) in windows if (r, e) == key] for key in ((0, 2), (0, 3), (1, 2))]
    assert orders[0] != orders[1] and orders[1] == orders[2]  # rotated by one at each turn, in JSON order
    assert len(windows[(0, "ckptd", 2)]["saves"]) == 2 and len(windows[(0, "ckptd-lazy", 3)]["saves"]) == 2
    assert windows[(0, "dcp-thread", 3)]["steps"] == 3 and len(windows[(0, "dcp-thread", 3)]["saves"]) == 1
    assert all(w["overhead"] is not None for w in result["windows"])
    assert set(result["first_save"]) == {"eager", "lazy"} and set(result["model"]) == {"2", "3"}
    assert result["first_save"]["lazy"]["first_reason"] == ""  # prepared: it waited for nothing
    assert "first prepared save, lazy" in run.stdout and "model" in run.stdout and "NOT judged" in run.stdout
    assert list(short_tmp.iterdir()) == []  # the daemon's root and socket, and DCP's files, are gone


@pytest.fixture
def bench_gpu_training(monkeypatch):
    """The module benchmarks/bench_gpu_training.py, imported as the script imports its neighbours."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module("bench_gpu_training")


def _window(r: int, variant: str, every: int, window_s: float, steps: int = 20, **save: float) -> dict:
    return {"round": r, "variant": variant, "every": every, "steps": steps, "window_s": window_s,
            "saves": [dict(save)] if save else []}  # fmt: skip


def test_the_overhead_is_held_against_none_of_the_same_round_and_the_median_taken(bench_gpu_training):
    windows = []
    for r, (none_s, lazy_s) in enumerate([(1.0, 1.005), (2.0, 2.2), (1.0, 1.02)]):  # round 1: a slow GPU
        windows += [_window(r, "none", 10, none_s), _window(r, "ckptd-lazy", 10, lazy_s, gpu_wait_s=0.001)]
    summary = bench_gpu_training.summarize(windows)
    assert summary[("ckptd-lazy", 10)]["overhead"] == pytest.approx(0.02)  # of 0.005, 0.1, 0.02
    assert summary[("ckptd-lazy", 10)]["gpu_wait_s"] == pytest.approx(0.001)
    assert summary[("none", 10)]["overhead"] == 0.0


def test_every_target_that_falls_short_says_no(bench_gpu_training):
    copy_s, state_bytes = 0.14, 7_600_000_000
    windows = []
    for r in range(3):
        windows += [_window(r, "none", 10, 1.0), _window(r, "none", 2, 1.0)]
        windows.append(_window(r, "ckptd-lazy", 10, 1.02, gpu_wait_s=0.004, spilled_bytes=0.5 * state_bytes))
        windows.append(_window(r, "ckptd-lazy", 2, 1.04, gpu_wait_s=0.008, spilled_bytes=0.7 * state_bytes))
    first = {"eager": {"first_step_s": 0.3, "ratio": 1.1}, "lazy": {"first_step_s": 0.1, "ratio": 1.3}}
    summary = bench_gpu_training.summarize(windows)
    rows = {r.what: r for r in bench_gpu_training.judge(summary, first, copy_s, state_bytes, [2, 10])}
    assert {w: r.ok for w, r in rows.items()} == {
        "ckptd-lazy, every 2: optimizer's GPU wait per save": False,  # 8 ms > 0.05 x 140 ms
        "ckptd-lazy, every 10: optimizer's GPU wait per save": True,
        "ckptd-lazy, every 10: spill per save": True,  # judged at every 10 only
        "ckptd-lazy, every 10: overhead": False,  # 2 % > 1 %
        "ckptd-lazy, every 2: overhead": True,  # 4 % <= 5 %
        "first prepared save, eager: the saving step on the GPU": True,
        "first prepared save, lazy: the saving step on the GPU": False,
    }


def test_dcp_windows_that_would_overrun_the_budget_are_left_out_and_ckptd_ones_counted(bench_gpu_training):
    args = bench_gpu_training.parse_args(["--rounds", "3", "--every", "1", "10", "--steps", "20", "--budget-s", "100"])
    figures = bench_gpu_training.gpu_timeline.Figures("test", 50e9, step_s=0.1)
    started = time.perf_counter()
    schedule = bench_gpu_training.Schedule(args, ["none", *args.variants], figures, 0.2, started)
    assert len(schedule.windows) == 3 * 2 * 5
    assert [v for r, e, v in schedule.windows[:5]] == ["none", "ckptd", "ckptd-lazy", "dcp-thread", "dcp-process"]
    assert [v for r, e, v in schedule.windows[5:10]] == ["ckptd", "ckptd-lazy", "dcp-thread", "dcp-process", "none"]
    assert schedule.estimate("ckptd", 1) == pytest.approx(20 * 0.1 + 20 * 0.2)  # the GPU idles for every copy
    assert schedule.estimate("ckptd-lazy", 10) == pytest.approx(20 * 0.1)  # the copy ends within the interval
    first_dcp = next(i for i, (_, _, v) in enumerate(schedule.windows) if v.startswith("dcp"))
    assert schedule.fits(first_dcp)  # ckptd's 3 rounds (about 50 s) and a DCP guess fit 100 s
    schedule.took[("dcp-thread", 1)] = 60.0
    assert not schedule.fits(first_dcp)  # a DCP window timed at 60 s no longer does
    second_round = next(i for i, (r, _, _) in enumerate(schedule.windows) if r == 1)
    assert schedule.round_fits(second_round)  # ckptd's round: about 16 s
    schedule.started -= 100
    assert not schedule.round_fits(second_round)  # 100 s gone: it would end 16 s after the budget and its slack
