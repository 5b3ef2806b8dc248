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
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ckpt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from daemon import BenchDaemon
from report import (
    Row,
    as_json,
    held,
    table,
    write_results,
)  # benchmarks/: run as scripts, this directory is on sys.path
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SAVE_RANKS = 4
LOAD_RANKS = 2
LAYERS = 4
COLUMNS = 4096
WARMUP_SAVES = 2  # the first save maps ckptd's slot and starts DCP's checkpoint process; the second its plan cache
WAIT_TIMEOUT_S = 600.0
RANKS_TIMEOUT_S = 1200.0
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
JOB = "bench-sharded"


@dataclass(frozen=True)
class Spec:
    """The shape of the state: LAYERS weights of rows x COLUMNS fp32 and their biases, each with AdamW moments."""

    rows: int

    @classmethod
    def of_size(cls, size_bytes: int) -> Spec:
        # 3 copies (weight, exp_avg, exp_avg_sq) of LAYERS x (rows x COLUMNS + rows) fp32 values.
        rows = size_bytes // (3 * LAYERS * (COLUMNS + 1) * 4)
        return cls(max(8, rows - rows % 8))  # splits evenly over 4 and over 2 ranks

    @property
    def size_bytes(self) -> int:
        return 3 * LAYERS * self.rows * (COLUMNS + 1) * 4

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Return each parameter's global shape by name."""
        found: dict[str, tuple[int, ...]] = {}
        for i in range(LAYERS):
            found[f"layers.{i}.weight"] = (self.rows, COLUMNS)
            found[f"layers.{i}.bias"] = (self.rows,)
        return found


def build_state(spec: Spec, mesh: DeviceMesh, fill: bool) -> dict[str, Any]:
    """Return an FSDP2-like state (model and AdamW state, DTensors sharded by rows) of this rank.

    With fill, the local shards are random but for column 0 (a 1-D tensor: every value),
    which holds the global row number, so a load can be checked against the layout;
    without, zeros (a target to load into). Every page is touched either way.
    """
    rank, world_size = mesh.get_local_rank(), mesh.size()
    generator = torch.Generator().manual_seed(1000 + rank)

    def sharded(shape: tuple[int, ...], salt: int) -> DTensor:
        rows = shape[0] // world_size
        local = torch.zeros((rows, *shape[1:]))
        if fill:
            local.normal_(generator=generator)
            first_rows = torch.arange(rank * rows, (rank + 1) * rows, dtype=torch.float32) + salt
            (local[:, 0] if local.dim() > 1 else local).copy_(first_rows)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model = {name: sharded(shape, 0) for name, shape in spec.shapes().items()}
    optim_state = {
        name: {"step": torch.tensor(7.0), "exp_avg": sharded(shape, 1), "exp_avg_sq": sharded(shape, 2)}
        for name, shape in spec.shapes().items()
    }
    param_groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(spec.shapes())}]
    return {"model": model, "optim": {"state": optim_state, "param_groups": param_groups}, "step": 7}


def local_tensors(state: Any) -> list[torch.Tensor]:
    """Return the local part of every tensor and DTensor of state, in a fixed order."""
    if isinstance(state, DTensor):
        return [state.to_local()]
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in local_tensors(state[k])]
    if isinstance(state, list | tuple):
        return [t for v in state for t in local_tensors(v)]
    return []


def check_rows(state: dict[str, Any], mesh: DeviceMesh, what: str) -> None:
    """Raise unless every sharded tensor's column 0 holds the global row numbers of this rank's rows."""
    rank, world_size = mesh.get_local_rank(), mesh.size()
    for salt, tensors in (
        (0, state["model"]),
        (1, {k: v["exp_avg"] for k, v in state["optim"]["state"].items()}),
        (2, {k: v["exp_avg_sq"] for k, v in state["optim"]["state"].items()}),
    ):
        for name, t in tensors.items():
            local = t.to_local()
            rows = local.shape[0]
            want = torch.arange(rank * rows, (rank + 1) * rows, dtype=torch.float32) + salt
            got = local[:, 0] if local.dim() > 1 else local
            if not torch.equal(got, want) or t.shape[0] != rows * world_size:
                raise RuntimeError(f"{what}: {name} (salt {salt}) on rank {rank} is not what was saved")
    if state["step"] != 7 or state["optim"]["param_groups"][0]["lr"] != 1e-3:
        raise RuntimeError(f"{what}: the values that are not tensors are not what was saved")


def evict_page_cache(paths: list[Path]) -> str:
    """Drop the files under paths from the page cache (all of it when allowed); return how."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for top in paths:
        for path in [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED)"


# -- the ranks ------------------------------------------------------------------------------------------------


def barrier_timed(fn: Any) -> float:
    """Start fn on every rank at once and return this rank's wall time for it."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_save(args: argparse.Namespace, mesh: DeviceMesh) -> dict[str, list[float]]:
    """Measure one rank's copy_, save_async and dcp.async_save, interleaved; every rank calls it at once."""
    spec = Spec(args.rows)
    rank = mesh.get_local_rank()
    state = build_state(spec, mesh, fill=True)
    sources = local_tensors(state)
    targets = [torch.empty_like(t) for t in sources]
    raw: dict[str, list[float]] = {k: [] for k in ("copy", "ckptd_stall", "ckptd_durable", "ckptd_blocked_in_daemon")}
    raw.update({"dcp_stall": [], "dcp_durable": []})

    def copy_all() -> None:
        for dst, src in zip(targets, sources, strict=True):
            dst.copy_(src)

    copy_all()  # touch every page of the targets
    checkpointer = ckpt.Checkpointer(job=JOB, rank=rank, world_size=mesh.size(), address=args.address)
    # The strongest CPU configuration torch 2.13 offers: no pinning (no CUDA), shared-memory staging in a
    # background thread, no non-blocking copies (CUDA only), a checkpoint process, and cached plans.
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp_root = Path(args.dcp_root)

    def ckptd_save(step: int, timed: bool) -> None:
        dist.barrier()
        start = time.perf_counter()
        handle = checkpointer.save_async(state, step=step)
        returned = time.perf_counter()
        handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
        if timed:
            raw["ckptd_stall"].append(returned - start)
            raw["ckptd_durable"].append(time.perf_counter() - start)
            raw["ckptd_blocked_in_daemon"].append(handle.blocked_s)

    def dcp_save(step: int, timed: bool) -> None:
        dist.barrier()
        start = time.perf_counter()
        response = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(dcp_root / f"step-{step}"),
            planner=planner,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        assert not isinstance(response, Future)  # an AsyncSaveResponse, with an async stager
        response.staging_completion.result()  # until then the caller may not change the state
        staged = time.perf_counter()
        response.upload_completion.result()
        if timed:
            raw["dcp_stall"].append(staged - start)
            raw["dcp_durable"].append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0 and step > 0:  # keep the newest checkpoint only: the load reads it
            shutil.rmtree(dcp_root / f"step-{step - 1}", ignore_errors=True)

    for step in range(WARMUP_SAVES):
        ckptd_save(step, timed=False)
        dcp_save(step, timed=False)
    for step in range(WARMUP_SAVES, WARMUP_SAVES + args.repeats):
        raw["copy"].append(barrier_timed(copy_all))
        ckptd_save(step, timed=True)
        dcp_save(step, timed=True)
    stager.close()
    checkpointer.close()
    return raw


def rank_load(args: argparse.Namespace, mesh: DeviceMesh) -> dict[str, list[float]]:
    """Measure one rank's resharded load, ckptd against dcp.load, the page cache dropped before each."""
    state = build_state(Spec(args.rows), mesh, fill=False)
    locals_ = local_tensors(state)
    rank = mesh.get_local_rank()
    raw: dict[str, list[float]] = {"ckptd_load": [], "dcp_load": [], "ckptd_load_memory": []}
    checkpointer = ckpt.Checkpointer(job=JOB, rank=rank, world_size=mesh.size(), address=args.address)
    reader_dir = Path(args.dcp_root) / f"step-{args.step}"
    files = [reader_dir, Path(args.ckptd_step_dir)]
    how = ""

    def evict() -> None:
        nonlocal how
        for t in locals_:
            t.fill_(-1.0)  # nothing right by accident
        if rank == 0:
            how = evict_page_cache(files)
        dist.barrier()

    for _ in range(args.repeats):
        evict()
        raw["ckptd_load"].append(barrier_timed(lambda: checkpointer.load(step=args.step, into=state, tier="nvme")))
        check_rows(state, mesh, "ckptd load")
        loaded = [t.clone() for t in locals_]
        evict()
        raw["dcp_load"].append(barrier_timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(reader_dir))))
        check_rows(state, mesh, "dcp.load")
        if not all(torch.equal(a, b) for a, b in zip(loaded, locals_, strict=True)):
            raise RuntimeError(f"rank {rank}: ckptd and dcp.load filled different values")
        del loaded
        raw["ckptd_load_memory"].append(
            barrier_timed(lambda: checkpointer.load(step=args.step, into=state, tier="memory"))
        )
    checkpointer.close()
    raw["evicted_with"] = [how]  # type: ignore[list-item]
    return raw


def run_rank(args: argparse.Namespace) -> int:
    """Run one rank of the save or the load phase; rank 0 writes every rank's timings to --out."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: ranks share the node's cores
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    raw = rank_save(args, mesh) if args.rank_phase == "save" else rank_load(args, mesh)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, raw)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    return 0


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
                command = [sys.executable, __file__, *argv]
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
    """Parse the command line (the driver's flags, and the ranks' own, hidden)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="total size of the sharded state in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed saves, and timed loads of each kind (default 5)")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where to write, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "sharded.json", help="where to write the results")
    hidden = argparse.SUPPRESS
    p.add_argument("--rank-phase", choices=("save", "load"), help=hidden)
    p.add_argument("--rows", type=int, help=hidden)
    p.add_argument("--address", help=hidden)
    p.add_argument("--dcp-root", help=hidden)
    p.add_argument("--ckptd-step-dir", help=hidden)
    p.add_argument("--step", type=int, help=hidden)
    p.add_argument("--out", help=hidden)
    return p.parse_args()


def main() -> int:
    """Start a daemon, run the save phase on 4 ranks and the load phase on 2, print the table, write the JSON."""
    args = parse_args()
    # dcp warns that it assumes a single process; the planner that it may not dedupe across ranks. Both known.
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.rank_phase:
        return run_rank(args)
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
