"""Benchmark ckptd's local path against its limits and against PyTorch's own checkpointers, in one run.

For one model-like state it measures save_async's blocking time against a plain copy_, the time
from save_async to durable on NVMe against direct writes (dd, and a 4-thread writer), loads from
NVMe and from memory against direct reads and a plain copy_, and beside them torch.save,
torch.distributed.checkpoint.save and async_save on the same disk. It prints a table and writes
JSON; it is not a test. See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_local.py --size-gib 2 --repeats 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ckpt
import gpu_path
import torch
import torch.distributed.checkpoint as dcp
from daemon import BenchDaemon
from report import (  # benchmarks/report.py: run as scripts, this directory is on sys.path
    Row,
    as_json,
    held,
    table,
    write_results,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DD_BLOCK_BYTES = 64 << 20
DIRECT_IO_ALIGN_BYTES = 4096
IO_BLOCK_BYTES = 32 << 20
IO_THREADS = 4
WARMUP_SAVES = 2
WAIT_TIMEOUT_S = 600.0
BURST_SAVES = 6  # saves back to back, no wait between: faster than any disk takes them
JOB = "bench"


def make_state(size_bytes: int, layers: int = 6) -> dict[str, torch.Tensor]:
    """Build a flat, model-like state of about size_bytes: bf16 weights, fp32 optimizer moments, small norms."""
    generator = torch.Generator().manual_seed(0)
    # (name, relative size in bytes, dtype) per layer; the two embeddings take a quarter of the state.
    per_layer = [
        ("attn.qkv", 3, torch.bfloat16),
        ("attn.out", 1, torch.bfloat16),
        ("mlp.up", 4, torch.bfloat16),
        ("mlp.down", 4, torch.bfloat16),
        ("attn.qkv.exp_avg", 6, torch.float32),
        ("mlp.up.exp_avg", 8, torch.float32),
    ]
    unit_bytes = 0.76 * size_bytes / (layers * sum(units for _, units, _ in per_layer))
    specs = [("embed", 0.12 * size_bytes, torch.bfloat16), ("lm_head", 0.12 * size_bytes, torch.bfloat16)]
    for i in range(layers):
        specs += [(f"layers.{i}.{name}", units * unit_bytes, dtype) for name, units, dtype in per_layer]
        specs += [(f"layers.{i}.norm.{j}", 16384, torch.float32) for j in (1, 2)]
    state = {}
    for name, nbytes, dtype in specs:
        element_size = torch.empty(0, dtype=dtype).element_size()
        rows = max(1, int(nbytes) // (1024 * element_size))
        state[name] = torch.randn(rows, 1024, dtype=dtype, generator=generator)
    return state


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    """Return the bytes of tensor data in a flat state."""
    return sum(t.numel() * t.element_size() for t in state.values())


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Call fn(*args, **kwargs) once and return its wall time in seconds; its result is freed after the clock stops."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def run_dd(*operands: str) -> float:
    """Run dd with operands and return its wall time in seconds."""
    return timed(subprocess.run, ["dd", *operands], check=True, capture_output=True)


def dd_write(path: Path, size_bytes: int) -> float:
    """Write size_bytes of zeros to a new file with direct I/O and fsync, delete it, and return dd's time."""
    operands = [f"of={path}", f"bs={DD_BLOCK_BYTES}", f"count={size_bytes}", "iflag=count_bytes"]
    elapsed = run_dd("if=/dev/zero", *operands, "oflag=direct", "conv=fsync")
    path.unlink()
    return elapsed


def direct_io(path: Path, size_bytes: int, write: bool) -> float:
    """Write (then fsync and delete) or read size_bytes of path with direct I/O from several threads; return the time.

    dd keeps one request in flight; this keeps IO_THREADS, as the daemon does, so it is the
    stronger limit where the disk gains from a deeper queue. Each thread reuses one touched
    buffer, so no page fault is timed.
    """
    buffers = [mmap.mmap(-1, IO_BLOCK_BYTES) for _ in range(IO_THREADS)]
    for buffer in buffers:
        buffer.write(b"\xa5" * IO_BLOCK_BYTES)

    def worker(index: int) -> None:
        view = memoryview(buffers[index])
        for offset in range(index * IO_BLOCK_BYTES, size_bytes, IO_THREADS * IO_BLOCK_BYTES):
            n = min(IO_BLOCK_BYTES, size_bytes - offset)
            if write and os.pwrite(fd, view[:n], offset) != n:
                raise OSError(f"short direct write to {path}")
            if not write:
                os.preadv(fd, [view[:n]], offset)  # the last block may end at the end of the file

    start = time.perf_counter()
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_DIRECT, 0o644)
    try:
        with ThreadPoolExecutor(IO_THREADS) as pool:
            list(pool.map(worker, range(IO_THREADS)))
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    if write:
        path.unlink()
    return elapsed


def plain_copier(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    """Return a function that copy_s every tensor into preallocated tensors whose pages are already touched."""
    dst = {name: torch.empty_like(t) for name, t in state.items()}

    def copy_all() -> None:
        for name, t in state.items():
            dst[name].copy_(t)

    copy_all()
    return copy_all


def clone_all(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy every tensor into fresh memory, page faults included, as any load that returns new tensors must."""
    return {name: t.clone() for name, t in state.items()}


def bench_ckpt(state: dict[str, torch.Tensor], sock: Path, root: Path, repeats: int) -> dict[str, list[float]]:
    """Save through the daemon, then load, each run interleaved with its limits; return raw timings.

    Interleaving keeps a limit and the measurement held against it under the same conditions
    (page cache, disk throttling, other load on the machine).
    """
    raw: dict[str, list[float]] = defaultdict(list)
    copy_all = plain_copier(state)
    io_bytes = -(-nbytes_of(state) // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(sock)) as c:
        for step in range(WARMUP_SAVES):
            c.save_async(state, step=step).wait("nvme", timeout=WAIT_TIMEOUT_S)
        for step in range(WARMUP_SAVES, WARMUP_SAVES + repeats):
            raw["plain_copy"].append(timed(copy_all))
            raw["dd_write"].append(dd_write(root / "dd-write.bin", io_bytes))
            raw["threads_write"].append(direct_io(root / "threads-write.bin", io_bytes, write=True))
            start = time.perf_counter()
            handle = c.save_async(state, step=step)
            returned = time.perf_counter()
            handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
            raw["save_block"].append(returned - start)
            raw["durable"].append(time.perf_counter() - start)
            raw["blocked_in_daemon"].append(handle.blocked_s)
        last = WARMUP_SAVES + repeats - 1
        shard_file = root / JOB / str(last) / "rank-00000.data"
        read_bytes = -(-shard_file.stat().st_size // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES
        for _ in range(repeats):
            raw["dd_read"].append(run_dd(f"if={shard_file}", "of=/dev/null", f"bs={DD_BLOCK_BYTES}", "iflag=direct"))
            raw["threads_read"].append(direct_io(shard_file, read_bytes, write=False))
            raw["load_nvme"].append(timed(c.load, step=last, tier="nvme"))
            raw["plain_copy"].append(timed(copy_all))
            raw["fresh_copy"].append(timed(clone_all, state))
            raw["load_memory"].append(timed(c.load, step=last, tier="memory"))
        for tier in ("nvme", "memory"):
            loaded = c.load(step=last, tier=tier)
            if loaded.keys() != state.keys() or not all(torch.equal(loaded[k], state[k]) for k in state):
                raise RuntimeError(f"load from {tier} did not return the saved state bit for bit")
        # The same state, owned by an optimizer, saved lazily: save_async returns before copying it.
        owner = torch.optim.SGD(list(state.values()), lr=0.0)  # noqa: F841 - ckpt.lazy finds it on the heap
        # The first lazy save also scans the heap for optimizers and installs the step hook: a warm-up.
        c.save_async(state, step=last + 1, lazy=True).wait("nvme", timeout=WAIT_TIMEOUT_S)
        for step in range(last + 2, last + 2 + repeats):
            raw["plain_copy"].append(timed(copy_all))
            start = time.perf_counter()
            handle = c.save_async(state, step=step, lazy=True)
            raw["lazy_block"].append(time.perf_counter() - start)
            handle.wait("memory", timeout=WAIT_TIMEOUT_S)
            raw["lazy_staged"].append(time.perf_counter() - start)
            handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
        # Saves back to back, faster than the disk: none waits for a flush (newest wins), some are passed over.
        first_burst = last + 2 + repeats
        raw["plain_copy"].append(timed(copy_all))
        handles = []
        for step in range(first_burst, first_burst + BURST_SAVES):
            start = time.perf_counter()
            handles.append(c.save_async(state, step=step))
            raw["burst_block"].append(time.perf_counter() - start)
        for handle in handles:
            try:
                handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
            except ckpt.SaveSkipped:
                raw["burst_passed_over"].append(1.0)
    # The first save of a job whose slots were prepared (Checkpointer.prepare) against a steady one.
    with ckpt.Checkpointer(job=f"{JOB}-first", rank=0, world_size=1, address=str(sock)) as c:
        c.prepare(state).result(timeout=WAIT_TIMEOUT_S)
        raw["plain_copy"].append(timed(copy_all))
        start = time.perf_counter()
        handle = c.save_async(state, step=0)
        raw["first_block"].append(time.perf_counter() - start)
        handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
    return dict(raw)


def bench_peers(state: dict[str, torch.Tensor], work: Path, repeats: int) -> dict[str, list[float]]:
    """Time torch.save + fsync, dcp.save and dcp.async_save of the same state on the same disk."""
    keys = ("torch_save", "torch_load", "dcp_save", "dcp_async_block", "dcp_async_durable")
    raw: dict[str, list[float]] = {k: [] for k in keys}

    def torch_save(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    for i in range(repeats):
        path = work / f"torch-{i}.pt"
        raw["torch_save"].append(timed(torch_save, path))
        drop_from_page_cache(path)  # so torch.load reads the disk, as our loads do
        raw["torch_load"].append(timed(torch.load, path, weights_only=True))
        path.unlink()
        raw["dcp_save"].append(timed(dcp.save, state, checkpoint_id=work / f"dcp-{i}", no_dist=True))
        shutil.rmtree(work / f"dcp-{i}")
        start = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=work / f"dcp-async-{i}", no_dist=True)
        raw["dcp_async_block"].append(time.perf_counter() - start)
        (response if isinstance(response, Future) else response.upload_completion).result()
        raw["dcp_async_durable"].append(time.perf_counter() - start)
        shutil.rmtree(work / f"dcp-async-{i}")
    return raw


def drop_from_page_cache(path: Path) -> None:
    """Evict a file's (clean, fsynced) pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def build_rows(size: int, raw: dict[str, list[float]]) -> tuple[list[Row], list[Row]]:
    """Turn raw timings into table rows: ours held against the limits, and the peers beside ours."""
    best = {k: min(v) for k, v in raw.items()}
    median = {k: statistics.median(v) for k, v in raw.items()}
    copy_s = best["plain_copy"]
    rows = [Row("plain copy_ (limit)", copy_s, size)]

    def disk_limit(kind: str) -> tuple[str, float]:
        """Add the dd and the threaded row for kind; return the name and GB/s of the faster one, the limit."""
        dd = Row(f"dd {kind} (limit)", best[f"dd_{kind}"], size)
        threaded = Row(f"{IO_THREADS}-thread {kind} (limit)", best[f"threads_{kind}"], size)
        rows.extend([dd, threaded])
        top = max(dd, threaded, key=lambda r: r.gb_per_s)
        return top.what.removesuffix(" (limit)"), top.gb_per_s

    for label, stat in (("best", best), ("median", median)):
        t = stat["save_block"]
        rows.append(held(f"save_async blocking ({label})", t, size, "plain copy_", t / copy_s, "<= 1.2"))
    for label, t in (("best", best["lazy_block"]), ("median", median["lazy_block"])):
        rows.append(held(f"save_async lazy=True blocking ({label})", t, size, "plain copy_", t / copy_s, "<= 0.1"))
    rows.append(Row("lazy=True until h.wait('memory') (info)", best["lazy_staged"], size))
    t = median["burst_block"]
    rows.append(held(f"save_async, {BURST_SAVES} back to back (median)", t, size, "plain copy_", t / copy_s, "<= 1.2"))
    t = best["first_block"]
    rows.append(held("first save of a prepared job", t, size, "steady save", t / median["save_block"], "<= 1.2"))
    limit, gb_per_s = disk_limit("write")
    for label, stat in (("best", best), ("median", median)):
        t = stat["durable"]
        rows.append(held(f"save -> durable on nvme ({label})", t, size, limit, size / t / 1e9 / gb_per_s, ">= 0.9"))
    limit, gb_per_s = disk_limit("read")
    for label, stat in (("best", best), ("median", median)):
        t = stat["load_nvme"]
        rows.append(held(f"load tier=nvme ({label})", t, size, limit, size / t / 1e9 / gb_per_s, ">= 0.8"))
    rows.append(Row("clone into fresh memory (info)", best["fresh_copy"], size))
    for label, stat in (("best", best), ("median", median)):
        t = stat["load_memory"]
        rows.append(held(f"load tier=memory ({label})", t, size, "plain copy_", copy_s / t, ">= 0.8"))
    # A load returns new memory: also hold it against a copy that must fault in new pages too.
    t = best["load_memory"]
    rows.append(held("load tier=memory (best)", t, size, "clone into fresh", best["fresh_copy"] / t, ">= 0.8"))
    peers = []
    for what, key, ours in (
        ("torch.save + fsync (durable)", "torch_save", "durable"),
        ("torch.load, from disk", "torch_load", "load_nvme"),
        ("dcp.save (durable)", "dcp_save", "durable"),
        ("dcp.async_save (blocking)", "dcp_async_block", "save_block"),
        ("dcp.async_save (durable)", "dcp_async_durable", "durable"),
    ):
        peers.append(Row(what, best[key], size, f"ckpt {ours}", best[key] / best[ours]))
    return rows, peers


def print_table(rows: list[Row], peers: list[Row]) -> None:
    """Print ours against the limits, then the peers with their time as a multiple of ours."""
    print(table(rows))
    print("\npeers (ratio = their best time / ckpt's best time for the same thing; > 1 means slower than ckpt)")
    print(table(peers))


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0, help="size of the state in GiB (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement (default 3)")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where to write, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "local.json", help="where to write the results")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the state lives (default cpu); cuda: the GPU path against copy_ into pinned memory "
        "(benchmarks/gpu_path.py), skipped with exit 0 where CUDA is not available",
    )
    return p.parse_args()


def main() -> int:
    """Run every measurement, print the table and write the JSON."""
    args = parse_args()
    if args.device == "cuda":
        args.dir.mkdir(parents=True, exist_ok=True)
        return gpu_path.run(args, make_state, nbytes_of)
    print(f"building a {args.size_gib} GiB state ...", flush=True)
    state = make_state(int(args.size_gib * (1 << 30)))
    size = nbytes_of(state)
    load_before = os.getloadavg()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=args.dir))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    print(f"{len(state)} tensors, {size / 1e9:.3f} GB; working in {work}, staging in {staging}", flush=True)
    try:
        daemon = BenchDaemon("bench-local", work, staging, toml="[retention]\nnvme = 2\n")
        try:
            daemon.start()
            raw = bench_ckpt(state, daemon.socket_path, daemon.root, args.repeats)
        finally:
            daemon_warnings = daemon.stop()
            daemon.kill()
        shutil.rmtree(staging)
        # dcp warns that it assumes a single process, which is what no_dist=True asks for.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        raw.update(bench_peers(state, work, args.repeats))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows, peers = build_rows(size, raw)
    print()
    print_table(rows, peers)
    passed = len(raw.get("burst_passed_over", []))
    print(f"\nof {BURST_SAVES} saves back to back, {passed} passed over on NVMe (a newer one replaced it first)")
    print("\nckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(
        args.json,
        load_before,
        rows,
        {"torch": torch.__version__},
        size_bytes=size,
        tensors=len(state),
        repeats=args.repeats,
        dir=str(args.dir.resolve()),
        peers=as_json(peers),
        raw_s=raw,
        daemon_warnings=daemon_warnings,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
