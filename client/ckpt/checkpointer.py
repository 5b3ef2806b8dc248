"""Checkpointer and SaveHandle: the training rank's side of ckpt."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ckpt import lazy as lazy_copies
from ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    InvalidArgument,
    NotFound,
    ReservationLost,
    SaveFailed,
    SaveSkipped,
)
from ckpt.flatten import flatten
from ckpt.format import (
    CommitRecord,
    layout_offset,
    validate_job,
    validate_rank,
    validate_step,
    validate_tier,
)
from ckpt.history import line_from_text
from ckpt.key_filter import KeyFilter, LoadReport
from ckpt.launcher import rank_and_world_size
from ckpt.local_read import checked_index, load_first_good
from ckpt.placement import Placement
from ckpt.range_read import StepReader
from ckpt.reshard import load_into, report_left
from ckpt.shard_io import ShardSource
from ckpt.staging import SlotMappings, copy_into, slot_view, writer_lock
from ckpt.step_index import StepIndex
from ckpt.transport import DaemonClient
from ckpt.wire.v1 import ckptd_pb2 as pb

log = logging.getLogger("ckpt")

# How long a blocked wait may sit in one RPC before asking again (keeps RPCs short-lived).
WAIT_SLICE_S = 30.0
# prepare() sizes the slots a little above the state it is given: a layout that grows by a few bytes still fits.
PREPARE_SLACK_BYTES = 1 << 20


class SaveHandle:
    """Follow one rank's shard of one save down the tiers.

    done(tier) asks whether the shard has reached a tier; wait(tier) blocks until
    it has, raising SaveFailed if it cannot, TimeoutError after timeout seconds,
    or SaveSkipped if the save was skipped for lack of staging room.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        step: int,
        skipped: bool,
        blocked_s: float,
        reason: str,
        staged: lazy_copies.LazyCopy | None = None,
    ) -> None:
        self._c = checkpointer
        self.step = step
        self.skipped = skipped
        self.blocked_s = blocked_s
        self.reason = reason
        self._staged = staged  # a lazy save's copy, until it committed

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "staged"
        return f"SaveHandle(job={self._c.job!r}, step={self.step}, rank={self._c.rank}, {state})"

    def _shard(self) -> pb.ShardId:
        return pb.ShardId(job=self._c.job, step=self.step, rank=self._c.rank, world_size=self._c.world_size)

    @property
    def spilled_bytes(self) -> int:
        """Return the bytes a lazy save copied device to device into the spill arena, then to the host."""
        return int(getattr(self._device_copy(), "spilled_bytes", 0))

    @property
    def direct_bytes(self) -> int:
        """Return the bytes a lazy save copied straight from the GPU tensors to the host (the head, and the rest)."""
        return int(getattr(self._device_copy(), "direct_bytes", 0))

    @property
    def gpu_wait_s(self) -> float | None:
        """Return the GPU time optimizer steps waited for this lazy save (spills included), from CUDA events.

        Known once the copy is done (after wait("memory")); None before, and for a save with no CUDA copy.
        """
        return getattr(self._device_copy(), "gpu_wait_s", None)

    def _device_copy(self) -> Any:
        """Return the lazy save's ckpt.cuda_staging.DeviceCopy, or None (no lazy CUDA copy)."""
        return self._staged.device if self._staged is not None else None

    def done(self, tier: str = "nvme") -> bool:
        """Return whether this rank's shard has reached tier."""
        validate_tier(tier)
        if self.skipped or not self._staged_within(0):
            return False
        reply = self._c._daemon.call("WaitShard", pb.WaitShardRequest(shard=self._shard(), tier=tier, timeout_s=0))
        _raise_for(reply)
        return bool(reply.done)

    def wait(self, tier: str = "nvme", timeout: float | None = None) -> None:
        """Block until this rank's shard has reached tier."""
        validate_tier(tier)
        if self.skipped:
            raise SaveSkipped(f"step {self.step} of job {self._c.job} was skipped: {self.reason}")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._staged_within(timeout):
            raise TimeoutError(f"step {self.step} of job {self._c.job} was not copied in {timeout} s")
        while True:
            slice_s = WAIT_SLICE_S if deadline is None else max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
            reply = self._c._daemon.call(
                "WaitShard",
                pb.WaitShardRequest(shard=self._shard(), tier=tier, timeout_s=slice_s),
                timeout_s=slice_s + 30,
            )
            _raise_for(reply)
            if reply.done:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"step {self.step} of job {self._c.job} did not reach {tier} in {timeout} s")

    def _staged_within(self, timeout: float | None) -> bool:
        """Return whether a lazy save's copy and commit finished within timeout (raise SaveFailed if they failed)."""
        if self._staged is None:
            return True
        try:
            return self._staged.wait(timeout)
        except ReservationLost:
            raise
        except Exception as e:
            raise SaveFailed(f"step {self.step} of job {self._c.job}: the background copy failed: {e}") from e


def _raise_for(reply: pb.WaitShardReply) -> None:
    if reply.passed_over:  # saves outran the disk: a newer snapshot replaced this one before its flush
        raise SaveSkipped(reply.error)
    if reply.error:
        raise SaveFailed(reply.error)


class Checkpointer:
    """Save and load one rank's share of a job's checkpoints through the local daemon.

    save_async() returns once the state is copied into shared memory; the daemon
    makes it durable afterwards. load() reads the fastest tier holding a verified
    copy. One Checkpointer per rank; its methods are not meant for concurrent use.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        address: str | None = None,
        **options: Any,
    ) -> None:
        self.job = validate_job(job if job is not None else os.environ.get("CKPT_JOB", ""))
        self.rank, self.world_size = validate_rank(*rank_and_world_size(rank, world_size))
        copy_threads = options.pop("copy_threads", 2)
        self.run_id = str(options.pop("run_id", None) or _default_run_id())
        spill_bytes = options.pop("spill_bytes", None)
        keep, keep_every = options.pop("keep", None), options.pop("keep_every", None)
        replicated = options.pop("replicated", None)
        if options:
            raise InvalidArgument(
                f"unknown Checkpointer options {sorted(options)}; known: copy_threads, keep, keep_every, replicated, "
                "run_id, spill_bytes"
            )
        # Keys whose plain tensors every rank holds alike (DDP): written once per step, by rank 0.
        self._replicated = None if replicated is None else KeyFilter.of(replicated, None)
        if len(self.run_id) > 256:
            raise InvalidArgument("run_id is longer than 256 characters")
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or not 1 <= copy_threads <= 64:
            raise InvalidArgument(f"copy_threads must be an integer from 1 to 64, not {copy_threads!r}")
        if spill_bytes is not None and (
            isinstance(spill_bytes, bool) or not isinstance(spill_bytes, int) or spill_bytes < 0
        ):
            raise InvalidArgument(
                f"spill_bytes must be None (a share of free GPU memory) or an integer >= 0, not {spill_bytes!r}"
            )
        self._spill_bytes: int | None = spill_bytes
        self._retention = _job_retention(keep, keep_every)  # sent on every Reserve; None: the daemon's config
        self._daemon = DaemonClient(address)
        self._slots = SlotMappings()
        self._copy_threads = copy_threads
        self._copy_pool = ThreadPoolExecutor(
            copy_threads, "ckpt-copy", initializer=lambda: lazy_copies.run_beside(self._daemon, widen=True)
        )
        self._lazy_thread = ThreadPoolExecutor(1, "ckpt-lazy", initializer=lambda: lazy_copies.run_beside(self._daemon))
        self._lazy_copy: lazy_copies.LazyCopy | None = None  # the last lazy save's copy, maybe still running
        self._link: Any = None  # cuda_staging.Link: what lazy saves learned of the GPU, once one had CUDA state
        self._arena: Any = None  # cuda_staging.SpillArena of lazy saves, made by prepare() or the first lazy save
        self._policy: str | None = None  # the daemon's [staging] policy, once asked
        self._preparing: Future[None] | None = None  # prepare()'s work in the background, until a save waited for it
        # The job's history (ckpt.history): the line this rank's saves continue, as the daemon named it at its
        # last load or save, and the step loaded or saved last. None: neither yet; a save continues the job's head.
        self._line: str | None = None
        self._last_step: int | None = None
        self._rolled_back_to: int | None = None  # a step older than the head was loaded: the next save forks
        self.last_load: LoadReport | None = None  # what the last load(into=...) left as it was
        self._closed = False

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the staging mappings and the connection; saves already made go on in the daemon."""
        if self._closed:
            return
        self._closed = True
        self._lazy_thread.shutdown(wait=True)  # a lazy save's copy and commit finish first
        self._arena = None  # its GPU memory back to torch's allocator now, not when a cycle is collected
        self._slots.close()
        self._copy_pool.shutdown(wait=True)
        self._daemon.close()

    def _shard(self, step: int) -> pb.ShardId:
        return pb.ShardId(job=self.job, step=step, rank=self.rank, world_size=self.world_size)

    def prepare(self, state: Any, lazy: bool = True) -> Future[None]:
        """Make this rank's staging slots ready for saves of state, in the background; return its future at once.

        Call it once the model and optimizer exist, before the first save (on the training thread).
        The daemon allocates the rank's slots, and a background thread maps and faults them in and,
        when state holds CUDA tensors, registers them with CUDA (cudaHostRegister): the first save
        then costs what any save costs. A save that comes before this is done waits for it and says
        so in its handle's blocked_s and reason. Sizes are taken from state now; a later state that
        is larger gets larger slots at its save. The future's result() raises what went wrong.

        With lazy (the default) it also readies save_async(lazy=True): the scan for optimizers (also those
        made since an earlier scan) and the step hook, here; and where an optimizer owns CUDA tensors, the
        spill arena (GPU memory set aside for the job, here) and a timed device-to-host copy (the link's
        first rate, in the background). A job that never saves lazily passes lazy=False and keeps both.
        """
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        flat = flatten(state, self._replicated, self.rank)
        size_bytes = layout_offset(flat.data_size_bytes) + len(json.dumps(flat.layout()).encode()) + PREPARE_SLACK_BYTES
        gpu = _gpu_of(flat.arrays)
        request = pb.ReserveRequest(shard=self._shard(0), size_bytes=size_bytes, prepare=True)
        probe = self._prepare_lazy(flat.arrays) if lazy else None

        def work() -> None:
            reply = self._daemon.call("Reserve", request, timeout_s=None)
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

    def save_async(self, state: Any, step: int | None = None, lazy: bool = False) -> SaveHandle:
        """Snapshot state into shared memory and return; the caller may change it at once.

        With lazy=True, return before the tensors an optimizer owns (its parameters and
        states) are copied: they are copied in the background while training goes on,
        and each optimizer's next step waits for its own tensors first (ckpt.lazy; for
        CUDA tensors the stepping stream waits on the GPU, the Python thread does not).
        Until h.wait("memory") returns, those tensors may be changed only by an optimizer
        step. Everything else is copied before save_async returns, as without lazy.

        Every copy is ordered after the work queued on the caller's current CUDA streams
        when save_async is called (events recorded here, on the calling thread).

        The handle's blocked_s is the time the save waited before its copy could start
        (the previous lazy copy, staging room, a new slot allocated, mapped or pinned,
        prepare() still at work), and reason says for what, and what a lazy save could not
        do lazily. A save while the calling thread's stream captures a CUDA graph is refused.
        """
        return self._save_async(state, step, lazy, None)

    def _save_async(self, state: Any, step: int | None, lazy: bool, ready: dict[int, Any] | None) -> SaveHandle:
        """Save as save_async; ready: the save's CUDA events, recorded by the caller on its own thread (ckpt.dcp)."""
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        waits = _Waits()
        if self._lazy_copy is not None and not self._lazy_copy.done.is_set():
            # Saves outrun the host copy itself. One copy into a slot at a time: wait for it, as
            # under [staging] policy "block", or skip this save under "skip".
            if self._staging_policy() == "skip":
                step = self._next_step(step)
                reason = "the previous lazy save's copy is still running (staging.policy = skip)"
                log.warning("ckpt: save of %s step %d skipped: %s", self.job, step, reason)
                return SaveHandle(self, step, True, 0.0, reason)
            with waits.timed("the previous lazy save's copy"):
                self._lazy_copy.done.wait()  # its own handle reports how it went
        if self._preparing is not None:
            if not self._preparing.done():
                with waits.timed("Checkpointer.prepare() mapping and pinning the slots"):
                    self._preparing.exception()  # waits; a failed preparation only leaves its work to this save
            self._preparing = None
        step = self._next_step(step)
        flat = flatten(state, self._replicated, self.rank)
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
        gpu = next(iter(ready)) if ready else None  # the first GPU of the state: slots are pinned there
        owned = lazy_copies.owners(flat.arrays) if lazy else {}
        notes = []
        if lazy:
            captured = lazy_copies.stepped_in_graphs(owned)
            for i in captured:
                del owned[i]
            if captured:
                notes.append(_said_once(
                    "lazy=True, but arrays of this state belong to an optimizer whose step was captured into a CUDA "
                    "graph (a replay runs no pre-hook): those were copied at the call"
                ))  # fmt: skip
            if not owned:
                notes.append(_said_once(
                    "lazy=True, but no known optimizer owns a tensor of this state (optimizers are found by a scan at "
                    "the first lazy save or prepare(), and by their steps): saved eagerly"
                ))  # fmt: skip
            if owned and on_device and self._arena is None:  # every lazy save with CUDA arrays has a DeviceCopy
                with waits.timed("allocating the spill arena of lazy saves (Checkpointer.prepare() does it ahead)"):
                    self._spill_arena([flat.arrays[i] for i in sorted(on_device & owned.keys())])
        layout = json.dumps(flat.layout()).encode()
        # The layout travels in the slot, after the data: megabytes for a large model never cross the socket.
        size_bytes = layout_offset(flat.data_size_bytes) + len(layout)
        asked = time.monotonic()
        request = pb.ReserveRequest(shard=self._shard(step), size_bytes=size_bytes, retention=self._retention)
        if self._line is not None and self._last_step is not None:
            request.has_line, request.line, request.after = True, self._line, self._last_step
        reserved = self._daemon.call("Reserve", request, timeout_s=None)
        if reserved.skipped:
            log.warning("ckpt: save of %s step %d skipped: %s", self.job, step, reserved.reason)
            return SaveHandle(self, step, True, 0.0, _reason(reserved.reason, *notes))
        if reserved.reason:  # staging room it waited for, or a slot it had to allocate ("new slot", "grew a slot")
            waits.add(time.monotonic() - asked, reserved.reason)
        held = contextlib.ExitStack()
        with held:
            held.enter_context(writer_lock(reserved.slot_path, f"job {self.job} rank {self.rank}"))
            if self._slots.mapped(reserved.slot_path, reserved.slot_size_bytes):
                slot = self._slots.get(reserved.slot_path, reserved.slot_size_bytes)
            else:
                with waits.timed("mapping and faulting in a new slot (Checkpointer.prepare() does it ahead)"):
                    slot = self._slots.get(reserved.slot_path, reserved.slot_size_bytes)
            if gpu is not None and not _cuda().pinned(slot):  # maybe being pinned in the background: wait for it
                with waits.timed("registering a new slot with CUDA (Checkpointer.prepare() does it ahead)"):
                    _cuda().pin(slot, gpu)
            if reserved.spare_slot_path:
                self._slots.prefault(reserved.spare_slot_path, reserved.spare_slot_size_bytes, gpu)
            if waits.blocked_s > 0.1:
                log.info("ckpt: save of %s step %d waited %.2f s: %s", self.job, step, waits.blocked_s, waits.reason)
            if owned and on_device and not _cuda().page_locked(slot):
                # A copy into pageable memory blocks the thread that issues it: no CUDA array can be left to a step.
                owned = {i: ids for i, ids in owned.items() if i not in on_device}
                on_device = frozenset()
                notes.append(_said_once(
                    "CUDA refused to page-lock the staging slot (cudaHostRegister): a lazy save copies CUDA tensors "
                    "at the call"
                ))  # fmt: skip
            # A lazy save copies the host arrays no optimizer owns now; CUDA ones go to its DeviceCopy (below).
            eager = set(range(len(flat.arrays))) - owned.keys() - on_device if owned else None  # None: all
            copy_into(flat, slot, self._copy_pool, self._copy_threads, only=eager, ready=ready)
            in_slot = reserved.layout_in_slot  # a daemon of an older version takes it in the message
            if in_slot:
                at = layout_offset(flat.data_size_bytes)
                slot[at : at + len(layout)].numpy()[:] = np.frombuffer(layout, dtype=np.uint8)
            request = pb.CommitRequest(
                shard=self._shard(step),
                slot_path=reserved.slot_path,
                data_size_bytes=flat.data_size_bytes,
                layout_size_bytes=len(layout) if in_slot else 0,
                layout_json=b"" if in_slot else layout,
                reservation=reserved.reservation,
                run_id=self.run_id,
                line=reserved.line,
            )
            staged = None
            if owned:
                staged = self._lazy_copy = lazy_copies.LazyCopy(owned, on_device & owned.keys())
                lock = held.pop_all()  # the lazy thread lets go of the slot once it committed
                try:
                    if on_device:  # every CUDA array, owned or not: none is copied on this thread
                        staged.device = device_copy = _cuda().DeviceCopy(
                            [(i, slot_view(flat, slot, i), flat.arrays[i]) for i in sorted(on_device)],
                            ready,
                            self._link,
                            self._arena,
                            now=on_device - owned.keys(),
                        )
                        if device_copy.held_bytes:
                            notes.append(
                                f"{device_copy.held_bytes} bytes no optimizer owns did not fit the spill arena: "
                                "copied to the host first, the caller's stream waiting for them on the GPU"
                            )

                    def copy(indices: list[int]) -> None:  # on the lazy thread alone: on the daemon's cores, if pinned
                        copy_into(flat, slot, self._copy_pool, 1, only=indices)

                    self._lazy_thread.submit(staged.run, copy, lambda: self._commit(request), lock.close)
                except BaseException as e:  # never started: no optimizer may wait for it
                    staged.abandon(e)
                    lock.close()
                    raise
            else:
                self._commit(request)
        if self._rolled_back_to is not None:
            log.warning(
                "ckpt: %s step %d starts a new line of the job from step %d, loaded before it (a rollback): the "
                "old line's steps after %d are superseded (docs/DESIGN.md, \"A job's history\")",
                *(self.job, step, self._rolled_back_to, self._rolled_back_to),
            )
            self._rolled_back_to = None
        self._line, self._last_step = reserved.line, step
        return SaveHandle(self, step, False, waits.blocked_s, _reason(waits.reason, *notes), staged)

    def _next_step(self, step: int | None) -> int:
        """Return the step to save: step itself, checked, or one past the step loaded or saved last, else the latest."""
        if step is None:
            latest = self._last_step if self._last_step is not None else self.latest_step()
            step = 0 if latest is None else latest + 1
        return validate_step(step)

    def _staging_policy(self) -> str:
        """Return the daemon's [staging] policy, asked once (only saves that outrun their host copy need it)."""
        if self._policy is None:
            try:
                self._policy = str(
                    json.loads(self._daemon.call("Status", pb.StatusRequest()).json)["staging"]["policy"]
                )
            except (KeyError, TypeError, ValueError):
                self._policy = "block"  # a daemon that does not say: wait, which loses nothing
        return self._policy

    def _commit(self, request: pb.CommitRequest) -> None:
        try:
            self._daemon.call("Commit", request)
        except ReservationLost as e:
            raise ReservationLost(f"{e}: the daemon restarted during this save; call save_async again") from None

    def latest_step(self) -> int | None:
        """Return the newest step of this job complete on any tier, or None."""
        # Asked of the step listing, not of this rank's shard: a job restarted with more
        # ranks than the step has must learn it too, and nothing is fetched to answer.
        # newest: the daemon answers from the cluster view (an older daemon lists every step).
        reply = self._daemon.call("List", pb.ListRequest(job=self.job, newest=True))
        return max((int(s.step) for s in reply.steps if s.job == self.job), default=None)

    def load(
        self,
        step: int | None = None,
        map_location: Any = "cpu",
        tier: str = "auto",
        into: Any = None,
        strict: bool = True,
        keys: str | Iterable[str] | None = None,
        exclude: str | Iterable[str] | None = None,
        weights_only: bool = False,
    ) -> Any:
        """Return this rank's state at step (default: the latest complete step), bit for bit as saved.

        tier picks one tier instead of the fastest verified copy ("auto"). The bytes
        are read once, straight into the memory the returned tensors use.

        map_location takes what torch.load takes (ckpt.placement). Each tensor is read
        into host memory, and its location is the device it was saved from ("cuda:N",
        or "cpu"; "cpu" for every tensor of a step saved before ckpt recorded devices):
        - a str or torch.device: every tensor goes there ("cpu", the default, copies nothing);
        - None: every tensor stays in host memory (unlike torch.load, which restores devices);
        - a dict {location: device}, e.g. {"cuda:1": "cuda:0"}: a tensor saved on a key goes
          to its value, any other back to its saved location;
        - a callable f(tensor, location): returns the tensor to use (same dtype and shape, any
          device), or None to send it back to its saved location; called once per tensor.
        A device this machine lacks ("cuda" on a CPU-only torch) raises InvalidArgument,
        saying so: a str or torch.device before anything is read, others as tensors are built.

        With into, fill its tensors and DTensors in place from the step, whatever the
        sharding, world size and mesh on either side, replace its other values, and
        return it (ckpt.reshard); map_location does not apply: each tensor stays where
        into holds it. A step that holds DTensors, or one saved by another world size, needs into.
        A tensor of into with another dtype gets the saved values cast to it, as dcp.load casts.

        Only with into: keys and exclude pick the keys loaded, glob patterns on dotted keys
        (ckpt.key_filter; exclude="optimizer" leaves the optimizer's state as it is); strict=False
        loads the keys both into and the step hold and leaves the rest, where strict=True raises
        InvalidArgument naming the first. self.last_load (a LoadReport) says what was left.

        weights_only=True unpickles the values that are not tensors as torch.load(weights_only=True)
        does: only the classes and functions torch allows (containers, scalars, torch.Size, dtypes,
        devices...) and those of torch.serialization.add_safe_globals; any other raises
        UnsafeCheckpoint naming it, before anything of the pickle runs (ckpt.skeleton_unpickler).
        weights_only=False (the default) unpickles them in full: only for checkpoints you trust.
        """
        if step is not None:
            validate_step(step)
        if tier != "auto":
            validate_tier(tier)
        selection = KeyFilter.of(keys, exclude)
        if into is not None:
            return self._load_into(into, step, tier, strict, selection, weights_only)
        if not strict or not selection.takes_all:
            raise InvalidArgument("strict=False, keys= and exclude= apply to load(into=state): pass the state to fill")
        place = Placement.of(map_location)  # before the daemon is asked: a device missing here fails at once
        locate = pb.LocateRequest(job=self.job, step=-1 if step is None else step, rank=self.rank, tier=tier)
        reply = self._daemon.call("Locate", locate)
        if reply.world_size != self.world_size:
            raise InvalidArgument(
                f"{self.job} step {reply.step} was saved by {reply.world_size} ranks, and this Checkpointer has "
                f"world_size {self.world_size}: rank {self.rank}'s shard of it belongs to another sharding. "
                f"To reshard it onto {self.world_size} ranks, load it with load(step={reply.step}, into=state), "
                "where state holds this rank's tensors (DTensors for the sharded ones) to fill in place"
            )
        sources = [ShardSource(s.tier, s.kind, s.path, self.job, reply.step) for s in reply.sources]
        self._loading(reply.step, reply.next_line)
        try:
            try:
                return load_first_good(sources, self.rank, place, weights_only=weights_only)
            except NotFound as e:  # the copy it was pointed at went meanwhile (an operator, a race): ask again, once
                log.warning("ckpt: %s; asking the daemon where the shard is now", e)
                locate.step = reply.step
                again = self._daemon.call("Locate", locate)
                sources = [ShardSource(s.tier, s.kind, s.path, self.job, again.step) for s in again.sources]
                return load_first_good(sources, self.rank, place, weights_only=weights_only)
        except CorruptCheckpoint as e:
            if tier not in ("auto", "peer", "object"):
                raise
            # Every copy on this node is bad: the daemon fetches a good one from the peers
            # or the object store, over them, and the load reads that.
            log.warning("ckpt: %s; asking the daemon for a good copy from another node or the object store", e)
            request = pb.LocateRequest(job=self.job, step=reply.step, rank=self.rank, tier=tier, refetch=True)
            try:
                again = self._daemon.call("Locate", request)
            except CheckpointError as other:
                raise CorruptCheckpoint(f"{e}; and no good copy elsewhere: {other}") from other
            sources = [ShardSource(s.tier, s.kind, s.path, self.job, again.step) for s in again.sources]
            return load_first_good(sources, self.rank, place, weights_only=weights_only)

    def _loading(self, step: int, next_line: str) -> None:
        """Continue this rank's saves after the step being loaded, on the line the daemon named.

        Loading a step older than the job's head and saving after it is a rollback: the next
        save starts a new line of the job's history from that step (docs/DESIGN.md). Every
        rank of the job loads the same step before its next save; the daemon refuses a step
        whose ranks' lines differ.
        """
        line = line_from_text(next_line, f"the line of {self.job} step {step}")
        self._rolled_back_to = step if line and line[-1][0] == step else None  # said at the next save
        self._line, self._last_step = next_line, step

    def _load_into(
        self, into: Any, step: int | None, tier: str, strict: bool, keys: KeyFilter, weights_only: bool
    ) -> Any:
        """Fill into from a step: the ranks this node holds read from their files, the rest through the daemon."""
        reader, index, reply = self._open_step(step, tier)
        self._loading(reply.step, reply.next_line)
        loaded, self.last_load = load_into(into, reader, index, self.rank, strict, keys, weights_only)
        report_left(self.last_load, self.job)
        return loaded

    def open_step(self, step: int | None = None, tier: str = "auto") -> tuple[StepReader, StepIndex | None]:
        """Return a reader of every rank's bytes of a complete step (default: the latest), and the step's index.

        Called on the loading thread by load(into=...) and ckpt.dcp's Reader. The ranks
        this node holds are read from their files, the rest through the daemon.
        """
        reader, index, _ = self._open_step(step, tier)
        return reader, index

    def _open_step(self, step: int | None, tier: str) -> tuple[StepReader, StepIndex | None, pb.LocateStepReply]:
        request = pb.LocateStepRequest(job=self.job, step=-1 if step is None else step, tier=tier)
        reply = self._daemon.call("LocateStep", request)
        record = CommitRecord.from_bytes(reply.commit_json, f"commit record of {self.job} step {reply.step}")
        local = {
            rank: [ShardSource(s.tier, s.kind, s.path, self.job, record.step) for s in held.sources]
            for rank, held in enumerate(reply.ranks)
        }

        def remote_meta(rank: int) -> bytes:
            request = pb.ReadShardRequest(job=self.job, step=record.step, rank=rank)
            first = next(iter(self._daemon.stream("ReadShard", request)), None)
            if first is None:
                raise CheckpointError(f"ckptd sent no record of rank {rank} shard of {self.job} step {record.step}")
            return bytes(first.meta_json)

        def remote_runs(rank: int, runs: list[tuple[int, int]]) -> Iterator[bytes]:
            ranges = [pb.ByteRange(offset=a, length=b - a) for a, b in runs]
            replies = self._daemon.stream(
                "ReadShard", pb.ReadShardRequest(job=self.job, step=record.step, rank=rank, ranges=ranges)
            )
            next(replies, None)  # the record, known already
            return (r.data for r in replies)

        reader = StepReader(self.job, record.step, record.shard_meta_xxh3_128, local, (remote_meta, remote_runs))
        return reader, checked_index(reply.index_json, record, f"index of {self.job} step {record.step}"), reply


class _Waits:
    """What one save_async waited for before its copy could start: the seconds, and the longest wait's reason."""

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


def _job_retention(keep: Any, keep_every: Any) -> pb.JobRetention | None:
    """Return the job's own retention for Reserve (only what was given), None if neither; check both first.

    keep: the newest complete steps of the job's line the daemon keeps on NVMe and the replica store
    (0: all); keep_every: it also keeps the steps that are multiples of it (0: none). Each overrides
    the daemon's [retention.jobs.<job>] and [retention] for this job.
    """
    given = {}
    for name, value in (("keep", keep), ("keep_every", keep_every)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise InvalidArgument(f"{name} must be None (the daemon's config) or an integer >= 0, not {value!r}")
        given[name] = value
    return pb.JobRetention(**given) if given else None


def _default_run_id() -> str:
    """Name this run of the job as torchrun does for every rank alike, or "" outside torchrun.

    The daemon never seals a step from shards of two runs: shards of a step left by
    a run that died are dropped once this run saves the step.
    """
    run, restart = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"torchelastic:{run}:{restart}" if run and restart is not None else ""
