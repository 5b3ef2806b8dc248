"""Checkpointer and SaveHandle: the training rank's public face of ckpt.

Checkpointer composes the roles: the daemon client (ckpt.transport), the save path
(ckpt.save_path) and the load path (ckpt.load_path); it checks the caller's arguments
and hands each call to the role that does it. SaveHandle follows one save down the tiers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from ckpt_core.errors import CheckpointError, InvalidArgument, ReservationLost, SaveFailed, SaveSkipped
from ckpt_core.format import validate_job, validate_rank, validate_step, validate_tier
from ckpt_core.step_index import StepIndex

from ckpt import lazy as lazy_copies
from ckpt.key_filter import KeyFilter, LoadReport
from ckpt.launcher import rank_and_world_size
from ckpt.load_path import LoadPath
from ckpt.placement import Placement
from ckpt.range_read import StepReader
from ckpt.save_path import SavePath
from ckpt.transport import DaemonClient, JobRetention, ShardId

# How long a blocked wait may sit in one RPC before asking again (keeps RPCs short-lived).
WAIT_SLICE_S = 30.0


class SaveHandle:
    """Follow one rank's shard of one save down the tiers.

    done(tier) asks whether the shard has reached a tier; wait(tier) blocks until
    it has, raising SaveFailed if it cannot, TimeoutError after timeout seconds,
    or SaveSkipped if the save was skipped for lack of staging room. Built by
    Checkpointer.save_async (or by anyone with the Checkpointer and a step it saved),
    it takes the checkpointer's daemon client and shard name at construction.
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
        self._daemon = checkpointer.daemon
        self._shard = ShardId(checkpointer.job, step, checkpointer.rank, checkpointer.world_size)
        self.step = step
        self.skipped = skipped
        self.blocked_s = blocked_s
        self.reason = reason
        self._staged = staged  # a lazy save's copy, until it committed

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "staged"
        return f"SaveHandle(job={self._shard.job!r}, step={self.step}, rank={self._shard.rank}, {state})"

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
        """Return whether this rank's shard has reached tier (False for a tier this node does not configure)."""
        validate_tier(tier)
        if self.skipped or not self._staged_within(0):
            return False
        return self._daemon.shard_reached(self._shard, tier, wait_s=0)

    def wait(self, tier: str = "nvme", timeout: float | None = None) -> None:
        """Block until this rank's shard has reached tier."""
        validate_tier(tier)
        job = self._shard.job
        if self.skipped:
            raise SaveSkipped(f"step {self.step} of job {job} was skipped: {self.reason}")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._staged_within(timeout):
            raise TimeoutError(f"step {self.step} of job {job} was not copied in {timeout} s")
        while True:
            slice_s = WAIT_SLICE_S if deadline is None else max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
            if self._daemon.shard_reached(self._shard, tier, wait_s=slice_s, timeout_s=slice_s + 30):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"step {self.step} of job {job} did not reach {tier} in {timeout} s")

    def _staged_within(self, timeout: float | None) -> bool:
        """Return whether a lazy save's copy and commit finished within timeout (raise SaveFailed if they failed)."""
        if self._staged is None:
            return True
        try:
            return self._staged.wait(timeout)
        except ReservationLost:
            raise
        except Exception as e:
            raise SaveFailed(f"step {self.step} of job {self._shard.job}: the background copy failed: {e}") from e


class Checkpointer:
    """Save and load one rank's share of a job's checkpoints through the local daemon.

    save_async() returns once the state is copied into shared memory; the daemon
    makes it durable afterwards. load() reads the fastest tier holding a verified
    copy. One Checkpointer per rank; its methods are not meant for concurrent use.
    Its roles: daemon (the one connection to the local daemon, which SaveHandle and
    ckpt.dcp share), the save path and the load path; the load path tells the save
    path which step the next save continues after.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        address: str | None = None,
        **options: Any,
    ) -> None:
        if job is None and not os.environ.get("CKPT_JOB"):
            raise InvalidArgument("a Checkpointer needs a job name: pass Checkpointer(job=...) or set CKPT_JOB")
        self.job = validate_job(job if job is not None else os.environ["CKPT_JOB"])
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
        keys = None if replicated is None else KeyFilter.of(replicated, None)
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
        retention = _job_retention(keep, keep_every)
        self.daemon = DaemonClient(address)
        shard = ShardId(self.job, 0, self.rank, self.world_size)
        self._saves = SavePath(self.daemon, shard, self.run_id, keys, retention, copy_threads, spill_bytes)
        self._loads = LoadPath(self.daemon, shard, located=self._saves.continue_after)
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
        self._saves.close()  # a lazy save's copy and commit finish first
        self.daemon.close()

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
        self._check_open()
        return self._saves.prepare(state, lazy)

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
        return self.save_after_events(state, step, lazy, None)

    def save_after_events(self, state: Any, step: int | None, lazy: bool, ready: dict[int, Any] | None) -> SaveHandle:
        """Save as save_async, its copies ordered after ready: {GPU index: CUDA event} recorded on another thread.

        For ckpt.dcp's stager, whose copy may run on DCP's upload thread while the events were
        recorded on the thread that called DCP. None: as save_async (this thread's streams).
        """
        self._check_open()
        saved = self._saves.save(state, step, lazy, ready)
        return SaveHandle(self, saved.step, saved.skipped, saved.blocked_s, saved.reason, saved.staged)

    def latest_step(self) -> int | None:
        """Return the newest step of this job complete on any tier, or None."""
        # Asked of the step listing, not of this rank's shard: a job restarted with more
        # ranks than the step has must learn it too, and nothing is fetched to answer.
        return self.daemon.newest_step(self.job)

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
            loaded, self.last_load = self._loads.load_into(into, step, tier, strict, selection, weights_only)
            return loaded
        if not strict or not selection.takes_all:
            raise InvalidArgument("strict=False, keys= and exclude= apply to load(into=state): pass the state to fill")
        place = Placement.of(map_location)  # before the daemon is asked: a device missing here fails at once
        return self._loads.load(step, place, tier, weights_only)

    def open_step(self, step: int | None = None, tier: str = "auto") -> tuple[StepReader, StepIndex | None]:
        """Return a reader of every rank's bytes of a complete step (default: the latest), and the step's index.

        Called on the loading thread by ckpt.dcp's Reader. The ranks this node holds are
        read from their files, the rest through the daemon.
        """
        return self._loads.open_step(step, tier)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")


def _job_retention(keep: Any, keep_every: Any) -> JobRetention:
    """Return the job's own retention for Reserve (only what was given); check both first.

    keep: the newest complete steps of the job's line the daemon keeps on NVMe and the replica store
    (0: all); keep_every: it also keeps the steps that are multiples of it (0: none). Each overrides
    the daemon's [retention.jobs.<job>] and [retention] for this job; None (not given) is the config's,
    sent as such, so that a later Checkpointer of the job without them takes back what an earlier one set.
    """
    given = {}
    for name, value in (("keep", keep), ("keep_every", keep_every)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise InvalidArgument(f"{name} must be None (the daemon's config) or an integer >= 0, not {value!r}")
        given[name] = value
    return JobRetention(**given)


def _default_run_id() -> str:
    """Name this run of the job as torchrun does for every rank alike, or "" outside torchrun.

    The daemon never seals a step from shards of two runs: shards of a step left by
    a run that died are dropped once this run saves the step.
    """
    run, restart = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"torchelastic:{run}:{restart}" if run and restart is not None else ""
