"""`bench_local.py --device cuda`: a state on the GPU, saved through ckptd, against copy_ into pinned host memory.

bench_local.main() hands over to run() when --device cuda is given. Without CUDA it
says so and returns 0 (scripts/gpu_check.sh runs on machines with and without a GPU).
With CUDA it measures, interleaved over the repeats: the limit, a copy_ of every tensor
into preallocated pinned host memory (non_blocking, then one synchronize), which is also
the device-to-host bandwidth; save_async's blocking time (the copy into the registered
staging slot on a side stream) and with lazy=True (the state owned by an optimizer);
and the time to durable on NVMe. The bytes saved are checked against the GPU's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ckpt
import torch
from daemon import BenchDaemon
from report import Row, held, table, write_results

WARMUP_SAVES = 2
WAIT_TIMEOUT_S = 600.0
JOB = "bench-gpu"


def pinned_copier(state: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Return the time of one copy_ of every tensor into pinned host memory, and that memory (allocated once)."""
    dst = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in state.items()}
    for _ in range(2):  # the first copy also faults in the pinned pages
        torch.cuda.synchronize()
        start = time.perf_counter()
        for name, t in state.items():
            dst[name].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return elapsed, dst


def bench(state: dict[str, torch.Tensor], sock: Path, repeats: int) -> dict[str, list[float]]:
    """Save the GPU state through the daemon, interleaved with the pinned copy; return raw timings."""
    raw: dict[str, list[float]] = {k: [] for k in ("pinned_copy", "save_block", "durable", "lazy_block")}
    owner = torch.optim.SGD(list(state.values()), lr=0.0)  # noqa: F841 - ckpt.lazy finds it for lazy=True
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(sock)) as c:
        for step in range(WARMUP_SAVES):
            c.save_async(state, step=step).wait("nvme", timeout=WAIT_TIMEOUT_S)
        step = WARMUP_SAVES
        for _ in range(repeats):
            raw["pinned_copy"].append(pinned_copier(state)[0])
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle = c.save_async(state, step=step)
            raw["save_block"].append(time.perf_counter() - start)
            handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
            raw["durable"].append(time.perf_counter() - start)
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle = c.save_async(state, step=step + 1, lazy=True)
            raw["lazy_block"].append(time.perf_counter() - start)
            handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
            step += 2
        loaded = c.load(step - 1)
        if any(not torch.equal(loaded[k], t.cpu()) for k, t in state.items()):
            raise RuntimeError("the saved bytes differ from the GPU state")
    return raw


def run(args: argparse.Namespace, make_state, nbytes_of) -> int:  # type: ignore[no-untyped-def]
    """Measure the GPU path, print the table and write the JSON; without CUDA, say so and return 0."""
    if not torch.cuda.is_available():
        print("CUDA is not available here (torch.cuda.is_available() is False): no GPU path to measure; skipped")
        return 0
    device = torch.cuda.get_device_name()
    state = {name: t.to("cuda") for name, t in make_state(int(args.size_gib * (1 << 30))).items()}
    size = nbytes_of(state)
    print(f"{len(state)} tensors, {size / 1e9:.3f} GB on {device}", flush=True)
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-bench-gpu-", dir="/dev/shm"))
    daemon = BenchDaemon("bench-gpu", work, staging, toml="[retention]\nnvme = 2\n")
    try:
        daemon.start()
        raw = bench(state, daemon.socket_path, args.repeats)
        daemon_warnings = daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    best = {k: min(v) for k, v in raw.items()}
    median = {k: statistics.median(v) for k, v in raw.items()}
    copy_s = best["pinned_copy"]
    rows = [Row("copy_ into pinned host memory (limit; D2H bandwidth)", copy_s, size)]
    for label, stat in (("best", best), ("median", median)):
        rows.append(held(f"save_async blocking ({label})", stat["save_block"], size, "pinned copy_",
                         stat["save_block"] / copy_s, "<= 1.2"))  # fmt: skip
        rows.append(held(f"save_async lazy=True blocking ({label})", stat["lazy_block"], size, "pinned copy_",
                         stat["lazy_block"] / copy_s, "<= 0.1"))  # fmt: skip
    rows.append(Row("save -> durable on nvme (info)", best["durable"], size))
    print(table(rows))
    print("\nckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(args.json, load_before, rows, {"torch": torch.__version__, "cuda": str(torch.version.cuda)},
                  device=device, size_bytes=size, repeats=args.repeats, raw_s=raw)  # fmt: skip
    return 0
