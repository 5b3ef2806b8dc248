"""`bench_local.py --device cuda`: a state on the GPU, saved through ckptd, against copy_ into pinned host memory.

bench_local.main() hands over to run() when --device cuda is given. Without CUDA it
says so and returns 0 (scripts/gpu_check.sh runs on machines with and without a GPU).
With CUDA it measures, interleaved over the repeats: the limit, a copy_ of every tensor
into preallocated pinned host memory (non_blocking, then one synchronize), which is also
the device-to-host bandwidth; save_async's blocking time (the copy into the registered
staging slot on a side stream); and the lazy path as a trainer meets it: save_async(lazy=True)
of the state an SGD optimizer owns, then at once that optimizer's step (lr 1, gradients of
ones: every tensor changes). The step's pre-hook must order the step after the copy on the
GPU without blocking the thread: the rows hold save_async's and the step's CPU time against
the copy, and give the GPU time the optimizer's stream waited (SaveHandle.gpu_wait_s; a step
with no forward pass before it, the worst case: the head has had no time). The lazy step's
bytes must be the values at the call, not the stepped ones, and every step's time to durable
on NVMe is timed. A row short of its target, or bytes that differ, exit 1.
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
    """Save the GPU state through the daemon, interleaved with the pinned copy; return raw timings.

    Raise if a step's saved bytes are not the GPU's values at its call.
    """
    keys = ("pinned_copy", "save_block", "durable", "lazy_block", "lazy_step_block", "lazy_gpu_wait", "lazy_spilled")
    raw: dict[str, list[float]] = {k: [] for k in keys}
    tensors = list(state.values())
    optimizer = torch.optim.SGD(tensors, lr=1.0)  # ckpt.lazy finds it (prepare's scan): it owns the whole state
    for t in tensors:
        t.grad = torch.ones_like(t)  # each step takes 1 from every value
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(sock)) as c:
        c.prepare(state).result(timeout=WAIT_TIMEOUT_S)  # slots mapped and pinned, the lazy path ready
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
            expected = {k: t.to("cpu", copy=True) for k, t in state.items()}  # the values at both calls
            start = time.perf_counter()
            handle = c.save_async(state, step=step + 1, lazy=True)
            stepping = time.perf_counter()
            optimizer.step()  # at once: its pre-hook orders it after the copy on the GPU, the thread goes on
            done = time.perf_counter()
            raw["lazy_block"].append(stepping - start)
            raw["lazy_step_block"].append(done - stepping)
            handle.wait("memory", timeout=WAIT_TIMEOUT_S)
            if handle.gpu_wait_s is None:
                raise RuntimeError(f"the lazy save was not lazy: {handle.reason}")
            raw["lazy_gpu_wait"].append(handle.gpu_wait_s)
            raw["lazy_spilled"].append(float(handle.spilled_bytes))
            handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
            for saved in (step, step + 1):  # nothing changed the state between the two calls: one snapshot
                loaded = c.load(saved)
                changed = [k for k, t in expected.items() if not torch.equal(loaded[k], t)]
                if changed:
                    raise RuntimeError(f"step {saved}'s bytes differ from the GPU's at its call: {changed[:5]}")
            step += 2
    for t in tensors:
        t.grad = None
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
        rows.append(held(f"optimizer.step() at once after it ({label})", stat["lazy_step_block"], size,
                         "pinned copy_", stat["lazy_step_block"] / copy_s, "<= 0.1"))  # fmt: skip
    wait_s = median["lazy_gpu_wait"]
    rows.append(Row("the step's GPU wait for the lazy copy (median, info)", max(wait_s, 1e-9), 0, "pinned copy_",
                    wait_s / copy_s))  # fmt: skip
    rows.append(Row("save -> durable on nvme (info)", best["durable"], size))
    print(table(rows))
    print(f"lazy: {median['lazy_spilled'] / 1e9:.2f} GB spilled into GPU memory a save (median)")
    print("\nckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(args.json, load_before, rows, {"torch": torch.__version__, "cuda": str(torch.version.cuda)},
                  device=device, size_bytes=size, repeats=args.repeats, raw_s=raw)  # fmt: skip
    return 1 if any(r.ok is False for r in rows) else 0
