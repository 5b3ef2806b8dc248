"""Save torch.distributed.checkpoint state dicts as ckptd steps: a StorageWriter that is its own AsyncStager.

What a step holds is what Checkpointer.save_async stores for the same nested state:
its tensors as chunks of global tensors (ckpt.sharding.LocalChunks, one per key, the
chunks DCP's planner gave this rank), its other values as they are, on every rank. So
ckpt.dcp.Reader and ckptd's own load(into=...) read a step saved either way.

The step of a save: the checkpoint_id given to dcp.save or dcp.async_save (an integer
or a string of digits; it reaches reset()), else the Writer's step (for its first save
only), else one past the latest step of the job, as save_async(step=None) picks it.
A save is done for DCP when every rank's shard is durable on NVMe: write_data waits
for that, so dcp.save returns, and async_save's future resolves, once it is.

dcp.async_save's process executor (AsyncCheckpointerType.PROCESS) sends the Writer
and the state to DCP's background process, which calls the Writer there: the copy
into ckptd's shared memory is made in that process, and the training thread waits in
synchronize_staging until it is (CopyReport), so the caller may change the state once
async_save returns, as with the thread executor.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
import weakref
from collections import defaultdict
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from ckpt_core.errors import CheckpointError, InvalidArgument
from ckpt_core.format import validate_step
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future
from torch.utils._pytree import tree_leaves

from ckpt.checkpointer import Checkpointer, SaveHandle
from ckpt.sharding import LocalChunks, OwnedChunk

# How long synchronize_staging waits for dcp.async_save's upload thread to set the save up: the thread executor
# does at once; the process executor's first save starts DCP's process and its process group first.
SET_UP_TIMEOUT_S = 600.0
# How long synchronize_staging waits for DCP's background process to copy a staged save once it was sent.
COPY_TIMEOUT_S = 600.0
# How often that wait looks whether DCP's upload thread, which sent it, has ended (the save failed before the copy).
COPY_POLL_S = 0.5
# The tier a save must reach before DCP counts it as written.
DURABLE_TIER = "nvme"


def checkpoint_step(checkpoint_id: object) -> int | None:
    """Return the step a DCP checkpoint_id names (an integer or a string of digits), or None if it names none."""
    if isinstance(checkpoint_id, str) and checkpoint_id.isascii() and checkpoint_id.isdigit():
        checkpoint_id = int(checkpoint_id)
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        return None
    try:
        return validate_step(checkpoint_id)
    except InvalidArgument:
        return None


def process_rank(rank: int | None, world_size: int | None) -> tuple[int | None, int | None]:
    """Fill a missing rank and world size from the default process group, if one is up (else the environment)."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    return rank, world_size


def _ready_events(state: Any) -> dict[int, Any] | None:
    """Record the save's events on the calling thread's current streams of the GPUs state is on (None: on none)."""
    leaves = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor) and t.is_cuda]
    if not leaves:
        return None
    from ckpt import cuda_staging  # only a process with CUDA state loads it

    return cuda_staging.ready_events(leaves)


class _Staged:
    """A state that dcp.async_save handed to stage(), and the save that copies it (once) into shared memory."""

    def __init__(self, state: Any) -> None:
        """Keep state, and record its CUDA events now: on the thread that called DCP, whose streams wrote it."""
        self.state = state
        self.ready = _ready_events(state)  # the copy may run on DCP's upload thread, whose streams order nothing
        self.step: int | None = None  # chosen when the upload thread sets the save up
        self.set_up = threading.Event()
        self.failure: BaseException | None = None  # why the save could not be set up
        self.lock = threading.Lock()  # one copy, whoever gets there first
        self.handle: SaveHandle | None = None
        self.copied_elsewhere: Connection | None = None  # sent to DCP's background process: it copies, and says so
        self.sender: threading.Thread | None = None  # DCP's upload thread, which sent it and waits for the save

    def copy(self, checkpointer: Checkpointer) -> SaveHandle:
        """Copy the state at the chosen step, unless that is done already; return the save's handle."""
        with self.lock:
            if self.failure is not None:
                raise self.failure
            if self.handle is None:
                assert self.step is not None
                self.handle = checkpointer.save_after_events(self.state, self.step, False, self.ready)
                self.state = None  # the copy is made: the live state is not kept past it
            return self.handle

    def await_copy(self, timeout_s: float) -> int:
        """Wait until DCP's background process has copied the state into shared memory; return the step it saved."""
        channel = self.copied_elsewhere
        assert channel is not None
        deadline = time.monotonic() + timeout_s
        try:
            # A save that fails before this rank's write_data (another rank's plan, say) never reaches the
            # Writer over there: DCP's upload thread then ends with the failure, and nothing more will come.
            while not channel.poll(COPY_POLL_S):
                if self.sender is not None and not self.sender.is_alive() and not channel.poll(0):
                    raise CheckpointError(
                        "dcp.async_save's save failed in its background process before this rank's copy: "
                        "its future says why"
                    )
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"dcp.async_save's background process did not copy the state into ckptd in {timeout_s:.0f} s"
                    )
            outcome, detail = channel.recv()
        except (EOFError, OSError) as e:
            raise CheckpointError(f"dcp.async_save's background process went away before copying: {e}") from None
        finally:
            channel.close()
            self.state = None
        if outcome != "copied":
            raise CheckpointError(f"dcp.async_save's background process could not copy the state: {detail}")
        return int(detail)


class CopyReport:
    """The background process's end of a staged save's hand-off: one message, ("copied", step) or ("failed", why).

    The training thread is held in synchronize_staging while DCP's background process
    reads the state (DCP sends it as shared memory over the caller's own tensors), so
    the copy is a snapshot; this message lets it go.
    """

    def __init__(self, channel: Connection) -> None:
        self._channel: Connection | None = channel

    def send(self, outcome: str, detail: object) -> None:
        """Send the one message (later calls do nothing) and close the channel."""
        channel, self._channel = self._channel, None
        if channel is None:
            return
        try:
            channel.send((outcome, detail))
        except OSError:
            pass  # the training process is gone or gave up waiting: nobody is left to tell
        finally:
            channel.close()


class Writer(StorageWriter, AsyncStager):
    """Save a DCP state dict as one step of a ckptd job, through the local daemon.

    dcp.save calls, on its own thread: reset(checkpoint_id) when one was given;
    set_up_storage_writer; prepare_local_plan; prepare_global_plan on the coordinator,
    which picks the step of every rank; write_data, which copies this rank's chunks
    into shared memory once (save_async) and waits until they are durable on NVMe;
    finish on the coordinator, which has nothing left to write: the daemon builds the
    step's index when it seals the step, and the Reader makes DCP's metadata from it.

    dcp.async_save calls stage() on the training thread, then the calls above on its
    upload thread, then synchronize_staging() on the training thread before returning.
    The step is known only once the upload thread has set the save up (a checkpoint_id
    reaches reset() there), so stage() keeps the state, and synchronize_staging() waits
    for the step and copies the state into shared memory: DTensors as the local shards
    this rank writes, other tensors and values as they are (save_async). write_data
    then copies nothing; it waits for that save. One save at a time per Writer.

    With the process executor (AsyncCheckpointerType.PROCESS), DCP pickles the Writer
    on its upload thread after stage(), and calls the methods above on the unpickled
    copy in its background process: there write_data copies the chunks (shared with
    the training process by DCP) into ckptd's shared memory, and tells the training
    thread, held in synchronize_staging, that it may go on (CopyReport). The daemon
    makes the step durable, as always; async_save's future resolves once it is on NVMe.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        address: str | None = None,
        step: int | None = None,
        keep: int | None = None,
    ) -> None:
        super().__init__()
        rank, world_size = process_rank(rank, world_size)
        self._step = None if step is None else validate_step(step)
        self._address = address
        self._keep = keep  # the job's retention (Checkpointer's keep=), sent with every save
        self._checkpointer = Checkpointer(job=job, rank=rank, world_size=world_size, address=address, keep=keep)
        # A Writer made inline for one save is never closed: release its connection when it goes, or at exit at
        # the latest (a gRPC channel left open at interpreter exit can abort the process).
        weakref.finalize(self, self._checkpointer.close)
        self._checkpoint_step: int | None = None  # from reset(checkpoint_id), for the next save only
        self._last_step: int | None = None
        # stage() hands its state to both threads: synchronize_staging takes one reference, the set-up the other.
        self._staging: _Staged | None = None
        self._pending: _Staged | None = None
        self._staged: _Staged | None = None  # the save in progress, when staged
        self._save_step: int | None = None  # this rank's step of the save in progress, when known here
        self._report: CopyReport | None = None  # in DCP's background process: whom to tell the copy is made

    def __repr__(self) -> str:
        c = self._checkpointer
        return f"ckpt.dcp.Writer(job={c.job!r}, rank={c.rank}, world_size={c.world_size})"

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Return what DCP's background process needs to save as this Writer (the process executor pickles it).

        A save staged here and not set up in this process is the one DCP is sending: it
        gets a channel, so that the copy made over there releases synchronize_staging.
        """
        c = self._checkpointer
        state: dict[str, Any] = {
            "job": c.job,
            "rank": c.rank,
            "world_size": c.world_size,
            "address": self._address,
            "step": self._step,
            "keep": self._keep,
            "last_step": self._last_step,
            "copied": None,
        }
        staged, self._pending = self._pending, None
        if staged is not None:
            receiver, sender = multiprocessing.Pipe(duplex=False)
            staged.copied_elsewhere = receiver
            staged.sender = threading.current_thread()
            staged.set_up.set()
            state["copied"] = sender  # DCP's pickler sends connections to the process it started
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Become the Writer DCP's background process calls, with a connection of its own to the daemon."""
        Writer.__init__(
            self, state["job"], state["rank"], state["world_size"], state["address"], state["step"], state["keep"]
        )
        self._last_step = state["last_step"]
        self._report = CopyReport(state["copied"]) if state["copied"] is not None else None

    def _fail_staging(self, error: BaseException) -> None:
        """Wake a synchronize_staging waiting for a save that will not be set up, with the reason."""
        staged, self._pending = self._pending or self._staging, None  # never set up: no later save may take it
        if staged is not None:
            staged.failure = error
            staged.set_up.set()
        if self._report is not None:
            self._report.send("failed", f"{type(error).__name__}: {error}")

    # -- the stager: dcp.async_save, training thread --------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Keep state_dict for synchronize_staging and return it; called first by dcp.async_save."""
        self._staging = self._pending = _Staged(state_dict)
        return state_dict

    def synchronize_staging(self) -> None:
        """Copy the state kept by stage() into shared memory at the save's step; the caller may then change it."""
        staged, self._staging = self._staging, None
        if staged is None:
            return
        if not staged.set_up.wait(SET_UP_TIMEOUT_S):
            if self._pending is staged:
                self._pending = None  # never set up: the next save must not take this state for its own
            staged.failure = CheckpointError(f"dcp.async_save did not set its save up in {SET_UP_TIMEOUT_S:.0f} s")
        if staged.copied_elsewhere is not None:
            self._last_step = staged.await_copy(COPY_TIMEOUT_S)  # the next pickled Writer counts on from it
            return
        staged.copy(self._checkpointer)

    def close(self) -> None:
        """Release the staging mappings and the connection to the daemon; saves already made go on there."""
        self._checkpointer.close()

    # -- the storage writer: dcp.save, its own thread ------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Take the step of the next save from checkpoint_id (an integer or a string of digits)."""
        if checkpoint_id is None:
            self._checkpoint_step = None
            return
        step = checkpoint_step(checkpoint_id)
        if step is None:
            error = InvalidArgument(
                f"checkpoint_id {checkpoint_id!r} is not a step: ckpt.dcp.Writer takes an integer or a string of digits"
            )
            self._fail_staging(error)
            raise error
        self._checkpoint_step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Say whether checkpoint_id names a step: an integer or a string of digits."""
        return checkpoint_step(checkpoint_id) is not None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Begin a save: fix its step where it is given, and (staged saves) pick it here and let the copy start."""
        explicit = self._checkpoint_step if self._checkpoint_step is not None else self._step
        self._checkpoint_step = None
        staged, self._pending = self._pending, None
        self._staged, self._save_step = staged, explicit
        if staged is None:
            return
        try:
            # The copy cannot wait for the coordinator's plan: each rank picks as save_async(step=None) does.
            staged.step = explicit if explicit is not None else self._next_step()
            self._save_step = staged.step
        except BaseException as e:
            staged.failure = e
            raise
        finally:
            staged.set_up.set()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Tell the coordinator the step this rank saves at, when it has one."""
        return dataclasses.replace(plan, storage_data=self._save_step)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give every rank the same step (coordinator): the one the ranks were given, else one past the latest."""
        steps = {p.storage_data for p in plans if p.storage_data is not None}
        if len(steps) > 1:
            error = InvalidArgument(
                f"the ranks would save this checkpoint as different steps {sorted(steps)}: "
                "give the step to every rank (checkpoint_id or ckpt.dcp.Writer(step=...))"
            )
            self._fail_staging(error)
            raise error
        try:
            step = steps.pop() if steps else self._next_step()
        except BaseException as e:
            self._fail_staging(e)
            raise
        return [dataclasses.replace(p, storage_data=step) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's share at the plan's step (or wait for the staged copy) and return once durable on NVMe."""
        step = validate_step(plan.storage_data)
        staged, self._staged = self._staged, None
        if staged is not None:
            if staged.step != step:
                raise CheckpointError(f"this rank staged step {staged.step}, and the coordinator planned step {step}")
            handle = staged.copy(self._checkpointer)
        else:
            try:
                handle = self._checkpointer.save_async(_state_of(plan, planner), step)
            except BaseException as e:
                self._fail_staging(e)
                raise
            if self._report is not None:
                self._report.send("copied", step)  # the training process may change its state again
        self._last_step = step
        handle.wait(DURABLE_TIER)
        future: Future[list[WriteResult]] = Future()
        future.set_result([WriteResult(item.index, _size_bytes(item), step) for item in plan.items])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Mark the checkpoint done (coordinator): nothing to write, the daemon sealed the step already."""

    def _next_step(self) -> int:
        latest = self._last_step if self._last_step is not None else self._checkpointer.latest_step()
        return 0 if latest is None else latest + 1


def _state_of(plan: SavePlan, planner: SavePlanner) -> Any:
    """Return the nested state this rank saves: each tensor as the chunks its plan writes, every value as it is.

    Every rank declares every tensor (with no chunks where DCP's planner gave its
    chunks to another rank) and keeps every value, so each rank's record holds the
    whole structure, as a native save's does.
    """
    flat_state = getattr(planner, "state_dict", None)
    if not isinstance(flat_state, dict):
        raise InvalidArgument(
            f"ckpt.dcp.Writer needs a DefaultSavePlanner or a subclass of it; {type(planner).__name__} "
            "keeps no flattened state_dict"
        )
    chunks: dict[str, list[OwnedChunk]] = defaultdict(list)
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        data = planner.resolve_data(item)
        sizes, offsets = item.tensor_data.chunk.sizes, item.tensor_data.chunk.offsets
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != tuple(sizes):
            raise InvalidArgument(f"{item.index.fqn}: the planner resolved a chunk of sizes {list(sizes)} to {data!r}")
        chunks[item.index.fqn].append(OwnedChunk(data.detach(), tuple(int(n) for n in offsets)))
    state: dict[str, Any] = {}
    for fqn, value in flat_state.items():
        if isinstance(value, torch.Tensor):  # a DTensor's shape is the global one
            state[fqn] = LocalChunks(tuple(value.shape), value.dtype, tuple(chunks.pop(fqn, ())))
        else:
            state[fqn] = value
    if chunks:
        raise InvalidArgument(f"the plan writes tensors the planner's state_dict does not hold: {sorted(chunks)[:5]}")
    mappings = getattr(planner, "mappings", None) if getattr(planner, "flatten_state_dict", False) else None
    return unflatten_state_dict(state, mappings) if mappings else state


def _size_bytes(item: WriteItem) -> int:
    """Return the bytes of a tensor item (values are counted as 0: their size is known only once pickled)."""
    if item.tensor_data is None:
        return 0
    count = 1
    for n in item.tensor_data.chunk.sizes:
        count *= int(n)
    return count * item.tensor_data.properties.dtype.itemsize
