"""The ranks of benchmarks/bench_sharded.py: each builds its shards of the state, saves or loads, and times it.

bench_sharded.py starts SAVE_RANKS (then LOAD_RANKS) copies of this script with
init_process_group's env:// variables and the flags below; rank 0 writes every rank's
timings, gathered, to --out. Not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

SAVE_RANKS = 4
LOAD_RANKS = 2
LAYERS = 4
COLUMNS = 4096
WARMUP_SAVES = 2  # the first save maps ckptd's slot and starts DCP's checkpoint process; the second its plan cache
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
JOB = "bench-sharded"
WAIT_TIMEOUT_S = 600.0


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


def parse_args() -> argparse.Namespace:
    """Parse the flags bench_sharded.py hands each rank."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-phase", choices=("save", "load"), required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--dcp-root", required=True)
    p.add_argument("--ckptd-step-dir")
    p.add_argument("--step", type=int)
    p.add_argument("--out", required=True)
    return p.parse_args()


if __name__ == "__main__":
    # dcp warns that it assumes a single process; the planner that it may not dedupe across ranks. Both known.
    warnings.filterwarnings("ignore", category=UserWarning)
    raise SystemExit(run_rank(parse_args()))
