"""Benchmark the daemon's core against a real `ckptd serve`: event-loop stalls under large commits, memory over saves.

Two measurements, each on a fresh daemon of its own, through the daemon's public interfaces only (its
config file, its gRPC protocol on the unix socket, its process in /proc):

- stall: 8 ranks of one job commit at the same moment, each a small shard with the layout a state of
  --tensors tensors produces (about 18 MB of JSON for 100,000), for --rounds steps. Meanwhile two
  probe threads call Status and WaitShard (timeout 0, on a shard already durable) in a tight loop.
  The probes' worst latency during the rounds is the event loop's longest stall as clients feel it;
  the same probes on the idle daemon, just before, are the reference.
- rss: --saves small saves (2 jobs of 4 ranks, one shard of 64 KiB per save, default retention),
  each rank waiting for its shard to be durable on NVMe before its next step. The daemon's resident
  memory after a warm-up and at the end says whether what it keeps per save is bounded.

It prints a table and writes JSON; it is not a test. See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_daemon_core.py                                  # both, full size
    .venv/bin/python benchmarks/bench_daemon_core.py --rounds 2 --saves 200           # quick check
    .venv/bin/python benchmarks/bench_daemon_core.py --only stall --tensors 20000
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import math
import mmap
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.transport import DaemonClient
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from daemon import BenchDaemon, daemon_env
from report import Row, write_results  # benchmarks/report.py: run as scripts, this directory is on sys.path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WAIT_SLICE_S = 60.0  # one WaitShard RPC waits at most this long in the daemon, as SaveHandle.wait does
RPC_TIMEOUT_S = 120.0
STALL_RANKS = 8
STALL_SHARD_BYTES = 1 << 20
# The layout OPERATIONS.md recommends: the daemon on a core of its own, the ranks on the others.
# With one CPU (or --shared-cpus) everything shares every core, and the stall measures the machine too.
ALL_CPUS = sorted(os.sched_getaffinity(0))
DAEMON_CPUS: set[int] = {ALL_CPUS[-1]} if len(ALL_CPUS) > 1 else set()
RANK_CPUS: set[int] = set(ALL_CPUS[:-1]) if len(ALL_CPUS) > 1 else set()
# Daemons that take the layout in the slot (after the data, at the next 4 KiB) get it there, as the client sends it;
# older ones (the protocol without layout_size_bytes) in the Commit message.
LAYOUT_IN_SLOT = "layout_size_bytes" in pb.CommitRequest.DESCRIPTOR.fields_by_name
IDLE_PROBE_S = 1.0  # probes on the idle daemon, after the rounds: the reference latency
RSS_JOBS = ("rss-a", "rss-b")
RSS_RANKS = 4
RSS_SHARD_BYTES = 64 << 10
RSS_LAYOUT_TENSORS = 24
RSS_WARMUP_SAVES = 100
RSS_SAMPLES = 10  # resident memory is read this many times after the warm-up
KIB = 1 << 10
MIB = 1 << 20


# -- the daemon ----------------------------------------------------------------------------


def daemon_module() -> str:
    """Return the file the daemon's `ckptd` package is imported from, started as the daemon is."""
    with tempfile.TemporaryDirectory() as cwd:
        found = subprocess.run(
            [sys.executable, "-c", "import ckptd; print(ckptd.__file__)"],
            capture_output=True,
            text=True,
            env=daemon_env(),
            cwd=cwd,
            check=True,
        )
    return found.stdout.strip()


@contextlib.contextmanager
def running_daemon(parent: Path, name: str, warnings: list[str]) -> Iterator[BenchDaemon]:
    """Yield a started daemon in fresh directories; stop it and remove everything it made, also on failure."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-core-{name}-", dir=parent))
    staging = Path(tempfile.mkdtemp(prefix=f"ckptd-bench-core-{name}-", dir="/dev/shm"))
    daemon = BenchDaemon(name, work, staging, cpus=DAEMON_CPUS)
    try:
        yield daemon.start()
        warnings += daemon.stop()
    except BaseException:
        print(f"ckptd's log ends with:\n{daemon.log()}", file=sys.stderr)
        raise
    finally:
        daemon.kill()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# -- one save, as ckpt.Checkpointer makes it -----------------------------------------------


def layout_at(data_size_bytes: int) -> int:
    """Return where the layout goes in a slot: after the data, at the next 4 KiB (ckpt_core.format.layout_offset)."""
    return -(-data_size_bytes // 4096) * 4096


def shard_id(job: str, step: int, rank: int, world_size: int) -> pb.ShardId:
    return pb.ShardId(job=job, step=step, rank=rank, world_size=world_size)


@contextlib.contextmanager
def staged(client: DaemonClient, shard: pb.ShardId, data: bytes, layout: bytes) -> Iterator[pb.ReserveReply]:
    """Reserve a slot and copy data (and the layout, where the daemon takes it there) into it; yield the
    reservation with the slot's writer lock held, for Commit.

    The client's own sequence (ckpt/save_path.py): Reserve, flock the slot, map it, copy, Commit.
    """
    size_bytes = layout_at(len(data)) + len(layout) if LAYOUT_IN_SLOT else len(data)
    reserved = client.call("Reserve", pb.ReserveRequest(shard=shard, size_bytes=size_bytes), timeout_s=None)
    if reserved.skipped:
        raise RuntimeError(f"the daemon skipped {shard.job} step {shard.step} rank {shard.rank}: {reserved.reason}")
    fd = os.open(reserved.slot_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with mmap.mmap(fd, reserved.slot_size_bytes) as slot:
            slot[: len(data)] = data
            if LAYOUT_IN_SLOT:
                slot[layout_at(len(data)) : layout_at(len(data)) + len(layout)] = layout
        yield reserved
    finally:
        os.close(fd)  # drops the lock


def commit(client: DaemonClient, shard: pb.ShardId, reserved: pb.ReserveReply, size_bytes: int, layout: bytes) -> None:
    request = pb.CommitRequest(
        shard=shard, slot_path=reserved.slot_path, data_size_bytes=size_bytes, reservation=reserved.reservation
    )
    if LAYOUT_IN_SLOT:
        request.layout_size_bytes = len(layout)
    else:
        request.layout_json = layout
    client.call("Commit", request, timeout_s=RPC_TIMEOUT_S)


def wait_durable(client: DaemonClient, shard: pb.ShardId) -> None:
    """Return once the shard is durable on NVMe; raise if it cannot get there."""
    while True:
        request = pb.WaitShardRequest(shard=shard, tier="nvme", timeout_s=WAIT_SLICE_S)
        reply = client.call("WaitShard", request, timeout_s=WAIT_SLICE_S + 30)
        if reply.error:
            raise RuntimeError(f"{shard.job} step {shard.step} rank {shard.rank} failed: {reply.error}")
        if reply.done:
            return


def save(client: DaemonClient, shard: pb.ShardId, data: bytes, layout: bytes) -> None:
    """Save one shard and wait until it is durable on NVMe."""
    with staged(client, shard, data, layout) as reserved:
        commit(client, shard, reserved, len(data), layout)
    wait_durable(client, shard)


def synthetic_layout(tensors: int) -> bytes:
    """Return the layout JSON a state of this many tensors would have: a mixture-of-experts model's table.

    The daemon keeps the layout as opaque text, so only its size and shape matter, not that it
    describes the bytes actually saved.
    """
    parts = (("w1", [1408, 2048]), ("w3", [1408, 2048]), ("w2", [2048, 1408]), ("norm", [2048]))
    entries, offset = [], 0
    for i in range(tensors):
        part, shape = parts[i % len(parts)]
        nbytes = math.prod(shape) * 2
        entries.append(
            {
                "key": f"layers.{i // 400}.experts.{i // len(parts) % 100}.{part}",
                "kind": "torch",
                "dtype": "bfloat16",
                "shape": shape,
                "nbytes": nbytes,
                "requires_grad": True,
                "parameter": True,
                "offset": offset,
            }
        )
        offset += nbytes
    return json.dumps({"tensors": entries, "skeleton_pickle_b64": ""}).encode()


# -- statistics ----------------------------------------------------------------------------


@dataclass
class Probe:
    """Call one cheap RPC in a loop on a thread of its own and record when each call started and how long it took."""

    name: str
    call: Callable[[], object]
    samples: list[tuple[float, float]] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            self.call()
            self.samples.append((start, time.perf_counter() - start))

    def latencies(self, begin: float, end: float) -> list[float]:
        """Return the latencies of the calls that started in [begin, end)."""
        return [latency for start, latency in self.samples if begin <= start < end]


def summary(latencies: list[float]) -> dict[str, float]:
    """Return count, median, p99 (nearest rank) and max of latencies in seconds."""
    if not latencies:
        return {"calls": 0, "p50_s": math.nan, "p99_s": math.nan, "max_s": math.nan}
    ordered = sorted(latencies)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return {"calls": len(ordered), "p50_s": statistics.median(ordered), "p99_s": p99, "max_s": ordered[-1]}


def first_error(futures: list[Future[Any]]) -> None:
    """Raise the first error of futures, preferring a real failure over the broken barrier it caused elsewhere."""
    errors = [f.exception() for f in futures if f.exception() is not None]
    errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]


# -- measurement 1: event-loop stall -------------------------------------------------------


def stall_rank(
    address: str,
    r: int,
    rounds: int,
    layout: bytes,
    size_bytes: int,
    commit_barrier: Any,
    round_barrier: Any,
    results: Any,
    rank_cpus: set[int],
) -> None:
    """Save rounds steps as rank r (a process of its own): commit together with the others, wait until durable."""
    report: dict[str, Any] = {"rank": r, "released": [], "durable_at": [], "commit_s": [], "error": ""}
    if rank_cpus:
        os.sched_setaffinity(0, rank_cpus)
    client = DaemonClient(address)
    data = os.urandom(size_bytes)
    try:
        for i in range(rounds):
            shard = shard_id("bench-stall", i + 1, r, STALL_RANKS)
            with staged(client, shard, data, layout) as reserved:
                commit_barrier.wait()
                start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the machine
                report["released"].append(start)
                commit(client, shard, reserved, len(data), layout)
                report["commit_s"].append(time.perf_counter() - start)
            wait_durable(client, shard)
            report["durable_at"].append(time.perf_counter())
            round_barrier.wait()  # the next step starts once this one is durable everywhere
    except BaseException as e:
        report["error"] = f"rank {r}: {type(e).__name__}: {e}"
        commit_barrier.abort()
        round_barrier.abort()
    finally:
        client.close()
        results.put(report)


def measure_stall(daemon: BenchDaemon, rounds: int, tensors: int) -> dict[str, Any]:
    """Commit STALL_RANKS shards with large layouts at once, for rounds steps, while probes time cheap RPCs."""
    layout = synthetic_layout(tensors)
    data = os.urandom(STALL_SHARD_BYTES)
    print(f"stall: {STALL_RANKS} ranks, {rounds} rounds, {tensors} tensors: layout of {len(layout) / 1e6:.1f} MB")

    setup = daemon.client()
    probe_shard = shard_id("bench-probe", 0, 0, 1)
    save(setup, probe_shard, data[: 64 * KIB], synthetic_layout(RSS_LAYOUT_TENSORS))
    probe_clients = [daemon.client(), daemon.client()]
    probes = [
        Probe("Status", lambda: probe_clients[0].call("Status", pb.StatusRequest(), timeout_s=RPC_TIMEOUT_S)),
        Probe(
            "WaitShard",
            lambda: probe_clients[1].call(
                "WaitShard", pb.WaitShardRequest(shard=probe_shard, tier="nvme", timeout_s=0), timeout_s=RPC_TIMEOUT_S
            ),
        ),
    ]
    # Ranks are processes of their own, as training ranks are: the probes time the daemon, not this process's GIL.
    spawn = multiprocessing.get_context("spawn")
    commit_barrier = spawn.Barrier(STALL_RANKS + 1)  # this process releases each round's commits too
    round_barrier = spawn.Barrier(STALL_RANKS)
    results = spawn.Queue()
    address = str(daemon.socket_path)
    ranks = [
        spawn.Process(
            target=stall_rank,
            args=(address, r, rounds, layout, len(data), commit_barrier, round_barrier, results, RANK_CPUS),
            name=f"rank-{r}",
        )
        for r in range(STALL_RANKS)
    ]
    stop = threading.Event()
    reports: list[dict[str, Any]] = []
    with ThreadPoolExecutor(len(probes), thread_name_prefix="probe") as probe_pool:
        probe_futures = [probe_pool.submit(p.run, stop) for p in probes]
        try:
            for process in ranks:
                process.start()
            for i in range(rounds):
                commit_barrier.wait(timeout=RPC_TIMEOUT_S)  # every rank has its slot: the round's commits go
                if i == 0:
                    load_begin = time.perf_counter()
            reports = [results.get(timeout=RPC_TIMEOUT_S * rounds) for _ in ranks]
            load_end = time.perf_counter()
            idle_begin = time.perf_counter()
            stop.wait(IDLE_PROBE_S)  # a measurement window after the rounds, not synchronisation
            idle_end = time.perf_counter()
        finally:
            stop.set()
            for process in ranks:
                process.join(timeout=RPC_TIMEOUT_S)
                if process.is_alive():
                    process.kill()
        first_error(probe_futures)
    status = daemon.status()
    for client in (setup, *probe_clients):
        client.close()
    failed = [r["error"] for r in reports if r.get("error")]
    if failed:
        raise RuntimeError(f"a rank failed: {failed[0]}")
    released = [min(r["released"][i] for r in reports) for i in range(rounds)]
    durable_at = [[r["durable_at"][i] for r in reports] for i in range(rounds)]
    commit_s = [[r["commit_s"][i] for r in reports] for i in range(rounds)]

    durable_s = [max(durable_at[i]) - released[i] for i in range(rounds)]
    all_idle = [x for p in probes for x in p.latencies(idle_begin, idle_end)]
    all_load = [x for p in probes for x in p.latencies(load_begin, load_end)]
    loop = status.get("event_loop")
    max_stall_s = loop.get("max_stall_s") if isinstance(loop, dict) else None
    return {
        "ranks": STALL_RANKS,
        "rounds": rounds,
        "tensors": tensors,
        "layout_bytes": len(layout),
        "shard_bytes": STALL_SHARD_BYTES,
        "probes_idle": {
            "all": summary(all_idle),
            **{p.name: summary(p.latencies(idle_begin, idle_end)) for p in probes},
        },
        "probes_during_rounds": {
            "all": summary(all_load),
            **{p.name: summary(p.latencies(load_begin, load_end)) for p in probes},
        },
        "window_s": load_end - load_begin,
        "durable_all_ranks_s": durable_s,
        "commit_rpc_s": commit_s,
        "status_event_loop_max_stall_s": max_stall_s,
        "daemon_version": str(status.get("version", "")),
    }


# -- measurement 2: bounded memory ---------------------------------------------------------


def measure_rss(daemon: BenchDaemon, saves: int) -> dict[str, Any]:
    """Make saves small saves (2 jobs x 4 ranks per step) and read the daemon's memory after a warm-up and along."""
    per_step = len(RSS_JOBS) * RSS_RANKS
    steps = max(2, saves // per_step)
    warmup_steps = min(math.ceil(RSS_WARMUP_SAVES / per_step), steps // 2)
    chunk = max(1, math.ceil((steps - warmup_steps) / RSS_SAMPLES))
    bounds = [0, *range(warmup_steps, steps, chunk), steps]
    print(f"rss: {steps * per_step} saves ({steps} steps of {per_step} shards), warm-up {warmup_steps * per_step}")
    data = os.urandom(RSS_SHARD_BYTES)
    layout = synthetic_layout(RSS_LAYOUT_TENSORS)
    clients = {(job, r): daemon.client() for job in RSS_JOBS for r in range(RSS_RANKS)}
    step_barriers = {job: threading.Barrier(RSS_RANKS) for job in RSS_JOBS}

    def rank(job: str, r: int, first: int, end: int) -> None:
        try:
            for step in range(first, end):
                step_barriers[job].wait()  # the ranks of a job save a step together, as training does
                save(clients[job, r], shard_id(job, step, r, RSS_RANKS), data, layout)
        except BaseException:
            for barrier in step_barriers.values():
                barrier.abort()
            raise

    samples: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(per_step, thread_name_prefix="rank") as pool:
            for first, end in itertools.pairwise(bounds):
                futures = [pool.submit(rank, job, r, first, end) for job, r in clients]
                first_error(futures)
                staging_bytes = sum(p.stat().st_size for p in daemon.staging.rglob("*") if p.is_file())
                nvme_steps = sum(1 for p in daemon.root.glob("*/*") if p.name.isdigit())
                sample = {"saves": end * per_step, "staging_bytes": staging_bytes, "nvme_steps": nvme_steps}
                samples.append({**sample, **daemon.memory()})
    finally:
        for client in clients.values():
            client.close()
    elapsed_s = time.perf_counter() - start
    version = str(daemon.status().get("version", ""))
    kept = {job: sorted(int(p.name) for p in (daemon.root / job).iterdir() if p.name.isdigit()) for job in RSS_JOBS}
    warm, end = samples[0], samples[-1]
    return {
        "saves": steps * per_step,
        "warmup_saves": warm["saves"],
        "shard_bytes": RSS_SHARD_BYTES,
        "layout_bytes": len(layout),
        "elapsed_s": elapsed_s,
        "saves_per_s": steps * per_step / elapsed_s,
        "rss_warm_bytes": warm["VmRSS"],
        "rss_end_bytes": end["VmRSS"],
        "rss_growth_bytes": end["VmRSS"] - warm["VmRSS"],
        "rss_anon_growth_bytes": end.get("RssAnon", 0) - warm.get("RssAnon", 0),
        "rss_growth_bytes_per_save": (end["VmRSS"] - warm["VmRSS"]) / max(1, end["saves"] - warm["saves"]),
        "nvme_steps_kept": kept,
        "daemon_version": version,
        "samples": samples,
    }


# -- output --------------------------------------------------------------------------------


def print_table(stall: dict[str, Any] | None, rss: dict[str, Any] | None) -> list[Row]:
    """Print what was measured as an aligned table; return the timed rows for the JSON."""
    lines: list[tuple[str, str]] = []
    rows: list[Row] = []
    if stall is not None:
        idle, load = stall["probes_idle"], stall["probes_during_rounds"]
        for name in ("Status", "WaitShard", "all"):
            lines.append(
                (
                    f"probe {name}: idle / during commits",
                    f"p99 {idle[name]['p99_s'] * 1e3:8.1f} / {load[name]['p99_s'] * 1e3:8.1f} ms   "
                    f"max {idle[name]['max_s'] * 1e3:8.1f} / {load[name]['max_s'] * 1e3:8.1f} ms   "
                    f"calls {idle[name]['calls']} / {load[name]['calls']}",
                )
            )
        lines.append(("longest stall clients saw (probe max)", f"{load['all']['max_s'] * 1e3:.1f} ms"))
        durable = stall["durable_all_ranks_s"]
        lines.append(
            (
                f"all {stall['ranks']} ranks durable on nvme",
                f"max {max(durable):.3f} s, median {statistics.median(durable):.3f} s over {len(durable)} rounds",
            )
        )
        commit_s = [x for per_round in stall["commit_rpc_s"] for x in per_round]
        lines.append(("Commit RPC", f"max {max(commit_s):.3f} s, median {statistics.median(commit_s):.3f} s"))
        reported = stall["status_event_loop_max_stall_s"]
        lines.append(
            (
                "status event_loop.max_stall_s",
                "not reported by this daemon" if reported is None else f"{float(reported) * 1e3:.1f} ms",
            )
        )
        rows += [
            Row("probe latency during commits (max)", load["all"]["max_s"], 0),
            Row("probe latency during commits (p99)", load["all"]["p99_s"], 0),
            Row("probe latency idle (max)", idle["all"]["max_s"], 0),
            Row(
                f"{stall['ranks']} ranks durable on nvme (max)",
                max(durable),
                stall["ranks"] * (stall["shard_bytes"] + stall["layout_bytes"]),
            ),
        ]
    if rss is not None:
        lines.append(
            (
                f"daemon RSS after {rss['warmup_saves']} / {rss['saves']} saves",
                f"{rss['rss_warm_bytes'] / MIB:.1f} / {rss['rss_end_bytes'] / MIB:.1f} MiB",
            )
        )
        lines.append(
            (
                "daemon RSS growth (anonymous part)",
                f"{rss['rss_growth_bytes'] / MIB:+.1f} MiB ({rss['rss_anon_growth_bytes'] / MIB:+.1f} MiB), "
                f"{rss['rss_growth_bytes_per_save']:.0f} bytes per save",
            )
        )
        first, last = rss["samples"][0], rss["samples"][-1]
        lines.append(
            (
                "threads, open fds, staging, nvme steps: warm / end",
                f"{first.get('Threads')} / {last.get('Threads')}, {first['open_fds']} / {last['open_fds']}, "
                f"{first['staging_bytes'] / MIB:.1f} / {last['staging_bytes'] / MIB:.1f} MiB, "
                f"{first['nvme_steps']} / {last['nvme_steps']}",
            )
        )
        kept = ", ".join(f"{job}: {steps}" for job, steps in rss["nvme_steps_kept"].items())
        lines.append(("steps on nvme per job at the end", kept))
        lines.append(("saves, each waited for until durable", f"{rss['saves_per_s']:.0f} saves/s"))
        rows.append(Row(f"{rss['saves']} saves", rss["elapsed_s"], rss["saves"] * rss["shard_bytes"]))
    width = max(len(what) for what, _ in lines)
    print(f"\n{'what':<{width}}  value\n{'-' * (width + 60)}")
    for what, value in lines:
        print(f"{what:<{width}}  {value}")
    return rows


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="steps the 8 ranks commit together (default 3)")
    p.add_argument("--tensors", type=int, default=100_000, help="tensors the stall layout describes (default 100000)")
    p.add_argument("--saves", type=int, default=2000, help="small saves for the memory measurement (default 2000)")
    p.add_argument("--only", choices=["stall", "rss"], help="run one measurement only")
    p.add_argument(
        "--shared-cpus",
        action="store_true",
        help="let the daemon and the ranks share every CPU (default: the daemon on the last CPU, ranks on the rest)",
    )
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the daemons' roots go")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "daemon_core.json", help="where to write the results")
    args = p.parse_args()
    if args.rounds < 1 or args.tensors < 1 or args.saves < 1:
        p.error("--rounds, --tensors and --saves must be positive")
    return args


def main() -> int:
    """Run the measurements, each on a daemon of its own, print the table and write the JSON."""
    args = parse_args()
    if args.shared_cpus:
        DAEMON_CPUS.clear()
        RANK_CPUS.clear()
    print(f"daemon on CPUs {sorted(DAEMON_CPUS) or 'all'}, ranks on CPUs {sorted(RANK_CPUS) or 'all'}")
    load_before = os.getloadavg()
    args.dir.mkdir(parents=True, exist_ok=True)
    module = daemon_module()
    print(f"ckptd from {module}")
    warnings: list[str] = []
    stall = rss = None
    if args.only in (None, "stall"):
        with running_daemon(args.dir, "stall", warnings) as daemon:
            stall = measure_stall(daemon, args.rounds, args.tensors)
    if args.only in (None, "rss"):
        with running_daemon(args.dir, "rss", warnings) as daemon:
            rss = measure_rss(daemon, args.saves)
    rows = print_table(stall, rss)
    print("\nckptd logged:", *warnings or ["no warnings"], sep="\n  ")
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "ckptd_module": module}
    env["ckptd"] = next((m["daemon_version"] for m in (stall, rss) if m is not None), "")
    write_results(args.json, load_before, rows, env, stall=stall, rss=rss, daemon_warnings=warnings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
