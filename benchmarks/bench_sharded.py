"""Benchmark ckptd on sharded state (DTensors over 4 ranks) against a plain copy and torch.distributed.checkpoint.

One run, side by side: save_async's stall against a copy_ of the same local shards, and
against dcp.async_save in its strongest CPU configuration (shared-memory staging in a
background thread, a checkpoint process, plan caching); then a resharded 4 -> 2 load,
Checkpointer.load(step, into=...) from NVMe against dcp.load of the same state from disk,
the page cache dropped before each. It prints a table and writes JSON; it is not a test.
See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_sharded.py --size-gib 1 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ckpt
import torch
from daemon import BenchDaemon
from report import (
    Row,
    as_json,
    held,
    table,
    write_results,
)  # benchmarks/: run as scripts, this directory is on sys.path
from sharded_ranks import COLUMNS, JOB, LAYERS, LOAD_RANKS, SAVE_RANKS, WARMUP_SAVES, Spec

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RANKS_SCRIPT = Path(__file__).resolve().parent / "sharded_ranks.py"
WAIT_TIMEOUT_S = 600.0
RANKS_TIMEOUT_S = 1200.0

# -- the driver -----------------------------------------------------------------------------------------------


def free_port() -> int:
    """Return a loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(world_size: int, argv: list[str], log_dir: Path, phase: str) -> None:
    """Run world_size ranks of this script with argv (init_process_group over env://); raise if one fails.

    Each rank is the leader of a session of its own, so that a failed run kills it with the
    checkpoint process it spawned, by process group.
    """
    port = free_port()
    procs = []
    try:
        for rank in range(world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",  # DCP's checkpoint process finds its own port on it
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            with open(log_dir / f"{phase}-rank{rank}.log", "wb") as log:
                command = [sys.executable, str(RANKS_SCRIPT), *argv]
                procs.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                log_text = (log_dir / f"{phase}-rank{rank}.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{phase} rank {rank} exited with {code}:\n{log_text}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_complete(address: str, step: int) -> None:
    """Return once step is complete on the daemon (the last rank's flush seals it a moment after its wait)."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=SAVE_RANKS, address=address) as c:
        while c.latest_step() != step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{JOB} step {step} not complete in {WAIT_TIMEOUT_S} s")
            time.sleep(0.05)


def aggregate(per_rank: list[dict[str, list[float]]], key: str) -> list[float]:
    """Return, for each repeat, the slowest rank's time: what a synchronous training step waits for."""
    return [max(times) for times in zip(*(r[key] for r in per_rank), strict=True)]


def build_rows(size: int, raw: dict[str, list[float]]) -> tuple[list[Row], list[Row]]:
    """Turn the aggregated timings into rows: ours against the limits, and the peers beside ours."""
    median = {k: statistics.median(v) for k, v in raw.items()}
    best = {k: min(v) for k, v in raw.items()}
    rows = [Row("plain copy_ of local shards (limit)", median["copy"], size)]
    for label, stat in (("median", median), ("best", best)):
        t = stat["ckptd_stall"]
        rows.append(held(f"save_async stall ({label})", t, size, "plain copy_", t / stat["copy"], "<= 1.2"))
    rows.append(Row("dcp.load, 4 -> 2 ranks (limit)", median["dcp_load"], size))
    for label, stat in (("median", median), ("best", best)):
        t = stat["ckptd_load"]
        rows.append(held(f"load into 2 ranks, nvme ({label})", t, size, "dcp.load", stat["dcp_load"] / t, ">= 1"))
    peers = [
        Row(
            f"dcp.async_save stall ({label})",
            stat["dcp_stall"],
            size,
            "ckpt stall",
            stat["dcp_stall"] / stat["ckptd_stall"],
        )
        for label, stat in (("median", median), ("best", best))
    ]
    durable = median["dcp_durable"]
    peers.append(
        Row("dcp.async_save durable (median)", durable, size, "ckpt durable", durable / median["ckptd_durable"])
    )
    peers.append(Row("save -> durable on nvme (median)", median["ckptd_durable"], size))
    peers.append(Row("load into 2 ranks, memory (median)", median["ckptd_load_memory"], size))
    return rows, peers


def per_rank_table(save: list[dict[str, list[float]]], load: list[dict[str, list[float]]]) -> str:
    """Format each rank's median of each measurement (seconds)."""
    lines = []
    for per_rank, keys in ((save, ("copy", "ckptd_stall", "dcp_stall")), (load, ("ckptd_load", "dcp_load"))):
        lines.append(f"{'rank':<6}" + "".join(f"{k:>14}" for k in keys))
        for rank, r in enumerate(per_rank):
            lines.append(f"{rank:<6}" + "".join(f"{statistics.median(r[k]):>14.3f}" for k in keys))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="total size of the sharded state in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed saves, and timed loads of each kind (default 5)")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where to write, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "sharded.json", help="where to write the results")
    return p.parse_args()


def main() -> int:
    """Start a daemon, run the save phase on 4 ranks and the load phase on 2, print the table, write the JSON."""
    args = parse_args()
    spec = Spec.of_size(int(args.size_gib * (1 << 30)))
    load_before = os.getloadavg()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=args.dir))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    dcp_root = work / "dcp"
    last = WARMUP_SAVES + args.repeats - 1
    print(
        f"sharded state of {spec.size_bytes / 2**30:.2f} GiB ({LAYERS} layers of {spec.rows} x {COLUMNS} fp32 and "
        f"biases, AdamW moments) over {SAVE_RANKS} ranks; working in {work}, staging in {staging}",
        flush=True,
    )
    daemon = BenchDaemon("bench-sharded", work, staging, toml="[retention]\nnvme = 2\n")
    try:
        daemon.start()
        common = ["--rows", str(spec.rows), "--address", str(daemon.socket_path), "--dcp-root", str(dcp_root)]
        common += ["--repeats", str(args.repeats)]
        started = time.perf_counter()
        launch_ranks(SAVE_RANKS, ["--rank-phase", "save", *common, "--out", str(work / "save.json")], work, "save")
        print(f"save phase: {time.perf_counter() - started:.0f} s", flush=True)
        wait_complete(str(daemon.socket_path), last)
        started = time.perf_counter()
        step_dir = daemon.root / JOB / str(last)
        load_argv = ["--rank-phase", "load", *common, "--step", str(last), "--ckptd-step-dir", str(step_dir)]
        launch_ranks(LOAD_RANKS, [*load_argv, "--out", str(work / "load.json")], work, "load")
        print(f"load phase: {time.perf_counter() - started:.0f} s", flush=True)
        save = json.loads((work / "save.json").read_text())
        load = json.loads((work / "load.json").read_text())
        status = daemon.status()
    finally:
        daemon_warnings = daemon.stop()
        daemon.kill()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    raw = {k: aggregate(save, k) for k in ("copy", "ckptd_stall", "ckptd_durable", "dcp_stall", "dcp_durable")}
    raw.update({k: aggregate(load, k) for k in ("ckptd_load", "dcp_load", "ckptd_load_memory")})
    rows, peers = build_rows(spec.size_bytes, raw)
    print(f"\n{' '.join([Path(sys.executable).name, *sys.argv])}\n")
    print(table(rows))
    print("\npeers (ratio = their time / ckpt's for the same thing; > 1 means slower than ckpt)")
    print(table(peers))
    print("\nper rank, median seconds (saves on 4 ranks, loads on 2):")
    print(per_rank_table(save, load))
    print(f"\npage cache before each load: {load[0]['evicted_with'][0]}")
    print("ckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(
        args.json,
        load_before,
        rows,
        {"torch": torch.__version__},
        size_bytes=spec.size_bytes,
        ranks={"save": SAVE_RANKS, "load": LOAD_RANKS},
        repeats=args.repeats,
        dir=str(args.dir.resolve()),
        peers=as_json(peers),
        raw_s=raw,
        per_rank_s={"save": save, "load": load},
        daemon_counters=status.get("counters", {}),
        daemon_warnings=daemon_warnings,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
