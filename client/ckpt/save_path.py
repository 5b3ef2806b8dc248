"""The save path of one rank: state -> staging slot -> the daemon's commit, in the save's order.

SavePath.save() is the whole order of one save; each step is a role of its own module:
flatten (ckpt.flatten), reserve and commit (ckpt.transport), map and copy into the slot
(ckpt.staging), the CUDA path (ckpt.cuda_staging), the lazy copy (ckpt.lazy), and the
job's history line that the next save continues (ckpt_core.history).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from ckpt_core.errors import CheckpointError, InvalidArgument
from ckpt_core.format import MAX_STEP, layout_offset, validate_step
from ckpt_core.history import line_from_text

from ckpt import lazy as lazy_copies
from ckpt.flatten import Flattened, flatten
from ckpt.key_filter import KeyFilter
from ckpt.staging import SlotMappings, copy_into, slot_view, writer_lock
from ckpt.transport import DaemonClient, JobRetention, Reservation, ShardCommit, ShardId

log = logging.getLogger("ckpt")

# prepare() sizes the slots a little above the state it is given: a layout that grows by a few bytes still fits.
PREPARE_SLACK_BYTES = 1 << 20
# The highest step a save may name: the 2**61 steps above it are left to step=None (SavePath._next_step).
MAX_NAMED_STEP = 2**61 - 1


@dataclasses.dataclass(frozen=True)
class SaveOutcome:
    """Say how one save went on the training thread: what SaveHandle is built from."""

    step: int
    skipped: bool
    blocked_s: float  # waited before the copy could start
    reason: str  # the longest wait's reason, then what the save could not do as asked
    staged: lazy_copies.LazyCopy | None = None  # a lazy save's copy, until it committed


@dataclasses.dataclass
class _CopyPlan:
    """Say where each array of one save is copied from, and when: now, on the lazy thread, or on a GPU stream."""

    on_device: frozenset[int]  # the CUDA arrays
    ready: dict[int, Any] | None  # the save's CUDA events by GPU index (None: no CUDA array)
    owned: dict[int, frozenset[int]]  # the arrays copied lazily: index -> ids of the optimizers that own it
    notes: list[str] = dataclasses.field(default_factory=list)  # what the save could not do as asked

    @property
    def gpu(self) -> int | None:
        """Return the first GPU of the state (its slots are pinned there), or None."""
        return next(iter(self.ready)) if self.ready else None

    def copied_now(self, count: int) -> set[int] | None:
        """Return the arrays the training thread copies: those no optimizer owns and not on a GPU (None: all)."""
        return set(range(count)) - self.owned.keys() - self.on_device if self.owned else None


class SavePath:
    """Take one rank's snapshots into its staging slots and commit them to the daemon, in the save's order.

    One per Checkpointer, on the training thread. Calls: prepare() (optional, before the first save),
    save() per save, continue_after() by the load path once it located a step, close() last. Its
    threads: the copy pool (copy_threads, during a save), the lazy thread (one lazy copy and its
    commit at a time), the slot mappings' prefault thread (ckpt.staging).
    """

    def __init__(
        self,
        daemon: DaemonClient,
        shard: ShardId,  # step 0: this rank's place in the job; each save names its step
        run_id: str,
        replicated: KeyFilter | None,
        retention: JobRetention,
        copy_threads: int,
        spill_bytes: int | None,
    ) -> None:
        self._daemon = daemon
        self._shard = shard
        self._run_id = run_id
        self._replicated = replicated  # keys whose plain tensors every rank holds alike: written by rank 0
        self._retention = retention  # sent on every Reserve, even empty: what it leaves out is the daemon's config
        self._spill_bytes = spill_bytes
        self._slots = SlotMappings()
        self._copy_threads = copy_threads
        self._copy_pool = ThreadPoolExecutor(
            copy_threads, "ckpt-copy", initializer=lambda: lazy_copies.run_beside(daemon, widen=True)
        )
        self._lazy_thread = ThreadPoolExecutor(1, "ckpt-lazy", initializer=lambda: lazy_copies.run_beside(daemon))
        self._lazy_copy: lazy_copies.LazyCopy | None = None  # the last lazy save's copy, maybe still running
        self._link: Any = None  # cuda_staging.Link: what lazy saves learned of the GPU, once one had CUDA state
        self._arena: Any = None  # cuda_staging.SpillArena of lazy saves, made by prepare() or the first lazy save
        self._policy: str | None = None  # the daemon's [staging] policy, once asked
        self._preparing: Future[None] | None = None  # prepare()'s work in the background, until a save waited for it
        # The job's history (ckpt_core.history): the line this rank's saves continue, as the daemon named it at its
        # last load or save, and the step loaded or saved last. None: neither yet; a save continues the job's head.
        self._line: str | None = None
        self._last_step: int | None = None
        self._rolled_back_to: int | None = None  # a step older than the head was loaded: the next save forks

    def close(self) -> None:
        """Finish a lazy save's copy and commit, then release the slots and the threads (training thread)."""
        self._lazy_thread.shutdown(wait=True)
        self._arena = None  # its GPU memory back to torch's allocator now, not when a cycle is collected
        self._slots.close()
        self._copy_pool.shutdown(wait=True)

    def prepare(self, state: Any, lazy: bool) -> Future[None]:
        """Have the daemon allocate slots for saves of state, mapped in the background (Checkpointer.prepare)."""
        flat = flatten(state, self._replicated, self._shard.rank)
        size_bytes = layout_offset(flat.data_size_bytes) + len(json.dumps(flat.layout()).encode()) + PREPARE_SLACK_BYTES
        gpu = _gpu_of(flat.arrays)
        probe = self._prepare_lazy(flat.arrays) if lazy else None

        def work() -> None:
            reply = self._daemon.prepare(self._shard, size_bytes)
            for path, size in (
                (reply.slot_path, reply.slot_size_bytes),
                (reply.spare_slot_path, reply.spare_slot_size_bytes),
            ):
                if path:
                    self._slots.map_ahead(path, size, gpu)  # already on the background thread
            if probe is not None:
                self._link.measure_rate(probe)  # the first estimate of the link, for the first lazy save's head

        self._preparing = self._slots.in_background(work)
        return self._preparing

    def _prepare_lazy(self, arrays: list[Any]) -> torch.Tensor | None:
        """Ready the lazy path: the optimizer scan and the hook, and for CUDA arrays the spill arena (training thread).

        Return the largest CUDA array an optimizer owns, which prepare()'s background thread times a
        copy of (the link's first rate), or None where no optimizer owns one.
        """
        owned = lazy_copies.owners(arrays, rescan=True)  # the scan of the heap for optimizers, and the hook
        cuda = [arrays[i] for i in owned if isinstance(arrays[i], torch.Tensor) and arrays[i].is_cuda]
        if not cuda:
            return None
        self._spill_arena(cuda)
        return max(cuda, key=lambda t: t.numel() * t.element_size())

    def _spill_arena(self, owned_cuda: list[Any]) -> None:
        """Make the Link and the SpillArena for these lazily saved CUDA arrays, unless made.

        The first arena holds ARENA_SHARE of their bytes per device (bounded by spill_bytes and by free
        memory); once saves have taught the tail, each copy's lazy thread fits it to that.
        """
        cuda = _cuda()
        if self._link is None:
            self._link = cuda.Link()
        if self._arena is not None:
            return
        self._arena = cuda.SpillArena(self._spill_bytes)
        if self._spill_bytes != 0:
            per_device: dict[int, int] = {}
            for t in owned_cuda:
                device = cuda.CUDA.device_of(t)
                per_device[device] = per_device.get(device, 0) + t.numel() * t.element_size()
            for device, nbytes in per_device.items():
                self._arena.ensure(device, int(nbytes * cuda.ARENA_SHARE))

    def save(self, state: Any, step: int | None, lazy: bool, ready: dict[int, Any] | None) -> SaveOutcome:
        """Snapshot state into a slot and commit it, in the save's order (Checkpointer.save_async's work).

        ready: the save's CUDA events, recorded by the caller on its own thread (ckpt.dcp), else None.
        """
        waits = _Waits()
        if not self._earlier_work_done(waits):
            step = self._next_step(step)
            reason = "the previous lazy save's copy is still running (staging.policy = skip)"
            log.warning("ckpt: save of %s step %d skipped: %s", self._shard.job, step, reason)
            return SaveOutcome(step, True, 0.0, reason)
        step = self._next_step(step)
        flat = flatten(state, self._replicated, self._shard.rank)
        plan = self._plan_copies(flat, lazy, ready, waits)
        layout = json.dumps(flat.layout()).encode()
        # The layout travels in the slot, after the data: megabytes for a large model never cross the socket.
        reserved = self._reserve(step, layout_offset(flat.data_size_bytes) + len(layout), waits)
        if reserved.skipped:
            log.warning("ckpt: save of %s step %d skipped: %s", self._shard.job, step, reserved.reason)
            return SaveOutcome(step, True, 0.0, _reason(reserved.reason, *plan.notes))
        held = contextlib.ExitStack()
        with held:
            held.enter_context(writer_lock(reserved.slot_path, f"job {self._shard.job} rank {self._shard.rank}"))
            slot = self._slot(reserved, plan, waits)
            if waits.blocked_s > 0.1:
                log.info(
                    "ckpt: save of %s step %d waited %.2f s: %s", self._shard.job, step, waits.blocked_s, waits.reason
                )
            copy_into(
                flat,
                slot,
                self._copy_pool,
                self._copy_threads,
                only=plan.copied_now(len(flat.arrays)),
                ready=plan.ready,
            )
            commit = self._layout_into(flat, layout, slot, reserved, step)
            staged = self._lazy_then_commit(flat, slot, plan, commit, held) if plan.owned else None
            if staged is None:
                self._daemon.commit(commit)
        self._continue_from_saved(step, reserved.line)
        return SaveOutcome(step, False, waits.blocked_s, _reason(waits.reason, *plan.notes), staged)

    def _earlier_work_done(self, waits: _Waits) -> bool:
        """Wait for the previous lazy save's copy and for prepare(); return False if this save is to be skipped.

        Saves outrun the host copy itself when a lazy copy still runs. One copy into a slot at a time:
        wait for it, as under [staging] policy "block", or skip this save under "skip".
        """
        if self._lazy_copy is not None and not self._lazy_copy.done.is_set():
            if self._staging_policy() == "skip":
                return False
            with waits.timed("the previous lazy save's copy"):
                self._lazy_copy.done.wait()  # its own handle reports how it went
        if self._preparing is not None:
            if not self._preparing.done():
                with waits.timed("Checkpointer.prepare() mapping and pinning the slots"):
                    self._preparing.exception()  # waits; a failed preparation only leaves its work to this save
            self._preparing = None
        return True

    def _plan_copies(self, flat: Flattened, lazy: bool, ready: dict[int, Any] | None, waits: _Waits) -> _CopyPlan:
        """Say which arrays are on a GPU (and the events their copies wait for) and which a lazy save leaves."""
        on_device = frozenset(i for i, a in enumerate(flat.arrays) if isinstance(a, torch.Tensor) and a.is_cuda)
        if on_device:
            if _cuda().CUDA.capturing(_gpu_of(flat.arrays)):
                raise CheckpointError(
                    "save_async was called while this thread's CUDA stream is capturing a graph: a save's copies "
                    "cannot be part of a graph. Save outside torch.cuda.graph() / before capture"
                )
            # First: the caller's streams, on this thread; events the caller recorded on its own thread win, and
            # a device its events miss (a tensor its walk did not reach) gets this thread's.
            ready = {**_cuda().ready_events(flat.arrays), **(ready or {})}
        plan = _CopyPlan(on_device, ready, lazy_copies.owners(flat.arrays) if lazy else {})
        if not lazy:
            return plan
        captured = lazy_copies.stepped_in_graphs(plan.owned)
        for i in captured:
            del plan.owned[i]
        if captured:
            plan.notes.append(_said_once(
                "lazy=True, but arrays of this state belong to an optimizer whose step was captured into a CUDA "
                "graph (a replay runs no pre-hook): those were copied at the call"
            ))  # fmt: skip
        if not plan.owned:
            plan.notes.append(_said_once(
                "lazy=True, but no known optimizer owns a tensor of this state (optimizers are found by a scan at "
                "the first lazy save or prepare(), and by their steps): saved eagerly"
            ))  # fmt: skip
        if plan.owned and on_device and self._arena is None:  # every lazy save with CUDA arrays has a DeviceCopy
            with waits.timed("allocating the spill arena of lazy saves (Checkpointer.prepare() does it ahead)"):
                self._spill_arena([flat.arrays[i] for i in sorted(on_device & plan.owned.keys())])
        return plan

    def _reserve(self, step: int, size_bytes: int, waits: _Waits) -> Reservation:
        """Reserve a slot for the step, continuing the line this rank loaded or saved last; count what it waited for."""
        asked = time.monotonic()
        after = (self._line, self._last_step) if self._line is not None and self._last_step is not None else None
        reserved = self._daemon.reserve(dataclasses.replace(self._shard, step=step), size_bytes, self._retention, after)
        if reserved.reason and not reserved.skipped:  # room it waited for, or a slot it had to allocate
            waits.add(time.monotonic() - asked, reserved.reason)
        return reserved

    def _slot(self, reserved: Reservation, plan: _CopyPlan, waits: _Waits) -> torch.Tensor:
        """Return the reserved slot mapped (and pinned for a CUDA state); map the spare one ahead in the background."""
        if self._slots.mapped(reserved.slot_path, reserved.slot_size_bytes):
            slot = self._slots.get(reserved.slot_path, reserved.slot_size_bytes)
        else:
            with waits.timed("mapping and faulting in a new slot (Checkpointer.prepare() does it ahead)"):
                slot = self._slots.get(reserved.slot_path, reserved.slot_size_bytes)
        gpu = plan.gpu
        if gpu is not None and not _cuda().pinned(slot):  # maybe being pinned in the background: wait for it
            with waits.timed("registering a new slot with CUDA (Checkpointer.prepare() does it ahead)"):
                _cuda().pin(slot, gpu)
        if reserved.spare_slot_path:
            self._slots.prefault(reserved.spare_slot_path, reserved.spare_slot_size_bytes, gpu)
        if plan.owned and plan.on_device and not _cuda().page_locked(slot):
            # A copy into pageable memory blocks the thread that issues it: no CUDA array can be left to a step.
            plan.owned = {i: ids for i, ids in plan.owned.items() if i not in plan.on_device}
            plan.on_device = frozenset()
            plan.notes.append(_said_once(
                "CUDA refused to page-lock the staging slot (cudaHostRegister): a lazy save copies CUDA tensors "
                "at the call"
            ))  # fmt: skip
        return slot

    def _layout_into(
        self, flat: Flattened, layout: bytes, slot: torch.Tensor, reserved: Reservation, step: int
    ) -> ShardCommit:
        """Write the layout after the data in the slot (a daemon of an older version takes it in the commit)."""
        in_slot = reserved.layout_in_slot
        if in_slot:
            at = layout_offset(flat.data_size_bytes)
            slot[at : at + len(layout)].numpy()[:] = np.frombuffer(layout, dtype=np.uint8)
        return ShardCommit(
            shard=dataclasses.replace(self._shard, step=step),
            slot_path=reserved.slot_path,
            data_size_bytes=flat.data_size_bytes,
            layout_size_bytes=len(layout) if in_slot else 0,
            layout_json=b"" if in_slot else layout,
            reservation=reserved.reservation,
            run_id=self._run_id,
            line=reserved.line,
        )

    def _lazy_then_commit(
        self, flat: Flattened, slot: torch.Tensor, plan: _CopyPlan, commit: ShardCommit, held: contextlib.ExitStack
    ) -> lazy_copies.LazyCopy:
        """Start the lazy copy of what optimizers own, which commits and lets go of the slot once done."""
        staged = self._lazy_copy = lazy_copies.LazyCopy(plan.owned, plan.on_device & plan.owned.keys())
        lock = held.pop_all()  # the lazy thread lets go of the slot once it committed
        try:
            if plan.on_device:  # every CUDA array, owned or not: none is copied on this thread
                staged.device = device_copy = _cuda().DeviceCopy(
                    [(i, slot_view(flat, slot, i), flat.arrays[i]) for i in sorted(plan.on_device)],
                    plan.ready,
                    self._link,
                    self._arena,
                    now=plan.on_device - plan.owned.keys(),
                )
                if device_copy.held_bytes:
                    plan.notes.append(
                        f"{device_copy.held_bytes} bytes no optimizer owns did not fit the spill arena: "
                        "copied to the host first, the caller's stream waiting for them on the GPU"
                    )

            def copy(indices: list[int]) -> None:  # on the lazy thread alone: on the daemon's cores, if pinned
                copy_into(flat, slot, self._copy_pool, 1, only=indices)

            self._lazy_thread.submit(staged.run, copy, lambda: self._daemon.commit(commit), lock.close)
        except BaseException as e:  # never started: no optimizer may wait for it
            staged.abandon(e)
            lock.close()
            raise
        return staged

    def continue_after(self, step: int, next_line: str) -> None:
        """Continue this rank's saves after a step being loaded, on the line the daemon named (the load path).

        Loading a step older than the job's head and saving after it is a rollback: the next
        save starts a new line of the job's history from that step (docs/DESIGN.md). Every
        rank of the job loads the same step before its next save; the daemon refuses a step
        whose ranks' lines differ.
        """
        line = line_from_text(next_line, f"the line of {self._shard.job} step {step}")
        self._rolled_back_to = step if line and line[-1][0] == step else None  # said at the next save
        self._line, self._last_step = next_line, step

    def _continue_from_saved(self, step: int, line: str) -> None:
        """Continue this rank's saves after the step just saved, saying once that it forked a new line."""
        if self._rolled_back_to is not None:
            log.warning(
                "ckpt: %s step %d starts a new line of the job from step %d, loaded before it (a rollback): the "
                "old line's steps after %d are superseded (docs/DESIGN.md, \"A job's history\")",
                *(self._shard.job, step, self._rolled_back_to, self._rolled_back_to),
            )
            self._rolled_back_to = None
        self._line, self._last_step = line, step

    def _next_step(self, step: int | None) -> int:
        """Return the step to save: step itself, checked, or one past the step loaded or saved last, else the latest.

        A step a caller names is at most MAX_NAMED_STEP, so that step=None, which counts on
        up to the format's 2**62-1, always has room: no single save can leave a job whose
        every next save is refused (a step below the head is refused as a rewind).
        """
        job = self._shard.job
        if step is None:
            latest = self._last_step if self._last_step is not None else self._daemon.newest_step(job)
            step = 0 if latest is None else latest + 1
            if step > MAX_STEP:
                raise InvalidArgument(
                    f"{job} has no step after {latest}, the highest a step can be: save under a new job name, "
                    f"or remove that step (ckptd rm --job {job} --step {latest}), or load an older one and "
                    "save after it (Checkpointer.load(step=N), a rollback)"
                )
            return step
        if validate_step(step) > MAX_NAMED_STEP:
            raise InvalidArgument(
                f"{job} step {step} is above 2**61-1, the highest step a save may name: after it the steps that "
                "step=None numbers would soon run out, and every later save of the job would be refused"
            )
        return step

    def _staging_policy(self) -> str:
        """Return the daemon's [staging] policy, asked once (only saves that outrun their host copy need it)."""
        if self._policy is None:
            try:
                self._policy = str(self._daemon.status()["staging"]["policy"])
            except (KeyError, TypeError, ValueError):
                self._policy = "block"  # a daemon that does not say: wait, which loses nothing
        return self._policy


class _Waits:
    """What one save waited for before its copy could start: the seconds, and the longest wait's reason."""

    def __init__(self) -> None:
        self.blocked_s = 0.0
        self.reason = ""
        self._longest_s = 0.0

    @contextlib.contextmanager
    def timed(self, reason: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(time.monotonic() - started, reason)

    def add(self, seconds: float, reason: str) -> None:
        """Count a wait that happened (the callers time only what was not ready: no RPC of a ready save counts)."""
        self.blocked_s += seconds
        if seconds >= self._longest_s:
            self.reason, self._longest_s = reason, seconds


def _reason(*parts: str) -> str:
    """Join what a save's handle says: the longest wait's reason, then what it could not do as asked."""
    return "; ".join(p for p in parts if p)


_said: set[str] = set()


def _said_once(note: str) -> str:
    """Log a note of a save's handle once per process (a note that holds for one save holds for every save)."""
    if note not in _said:
        _said.add(note)
        log.warning("ckpt: %s", note)
    return note


def _cuda() -> Any:
    """Return ckpt.cuda_staging, imported on first use: only a process that saves CUDA tensors loads it."""
    from ckpt import cuda_staging

    return cuda_staging


def _gpu_of(arrays: list[Any]) -> int | None:
    """Return the index of the first GPU the arrays are on, or None where none is on a GPU."""
    for array in arrays:
        if isinstance(array, torch.Tensor) and array.is_cuda:
            return array.device.index if array.device.index is not None else torch.cuda.current_device()
    return None
