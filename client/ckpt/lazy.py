"""The lazy snapshot of save_async(lazy=True): what an optimizer owns is copied while training goes on.

The save path (ckpt.save_path, for save_async(lazy=True)), on the training thread, calls owners() to find the
arrays of the flattened state whose bytes overlap a known optimizer's parameters or
states, copies every other array into the slot at once, and hands a LazyCopy of the owned
ones to its lazy thread. That thread runs LazyCopy.run(): the owned host arrays, group by
group (a group: the arrays the same optimizers own), then the owned CUDA arrays
(ckpt.cuda_staging.DeviceCopy: the head of them issued at the save, the rest spilled at the
step or issued once the head landed, all ordered after the events save_async recorded on
the caller's streams), then the commit.

Before any optimizer steps, torch calls _before_step (a global optimizer step pre-hook,
installed once per process by the first lazy save) on the training thread. In every
LazyCopy still running, for the groups the stepping optimizer owns, it waits on the CPU
for their host arrays, and orders the stepping stream after the copies of their CUDA
arrays on the GPU (DeviceCopy.before_step: a wait_event for the head, a spill into the
GPU's spill arena of what is not copied yet), so a step never changes a tensor before its bytes are saved and
the Python thread does not block for the GPU's copies. SaveHandle.wait() and the rank's
next save wait for the whole copy. The hook never waits for the commit, only for copies,
which need nothing from the training thread.

The lazy thread starts with run_beside(): it moves onto the CPUs the daemon runs on ([node] cpus),
so the background copy takes the daemon's cores and leaves the trainer's alone.

Optimizers are known from a scan of the heap at the first lazy save (or Checkpointer.prepare),
and from every step any optimizer takes afterwards (the same hook records it). An optimizer
not known yet owns nothing: its tensors are copied at once, which is always safe. An optimizer
the hook sees stepping while a CUDA graph is captured is remembered: a replay of the graph runs
no hook, so in later lazy saves its tensors are copied at the call (stepped_in_graphs), and a
capture while a lazy copy of its tensors runs is refused (ckpt.cuda_staging.GraphCaptured).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from ckpt_core.errors import CheckpointError
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ckpt.transport import DaemonClient

log = logging.getLogger("ckpt")

_known: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_captured: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # stepped while a CUDA graph was captured
_running: set[LazyCopy] = set()
_lock = threading.Lock()
_hook: Any = None


def owners(arrays: list[Any], rescan: bool = False) -> dict[int, frozenset[int]]:
    """Return {index of an array: ids of the known optimizers whose tensors overlap its bytes} (training thread).

    The heap is scanned for optimizers at the first call, and again with rescan (Checkpointer.prepare:
    an optimizer made since, which has not stepped yet, would own nothing).
    """
    install_hook()
    if rescan or not _known:
        # type(o), not isinstance: some module objects answer __class__ with a deprecation warning.
        _known.update(o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer))
    spans = sorted(
        (start, end, id(optimizer))
        for optimizer in list(_known)
        for start, end in map(_span, _optimizer_tensors(optimizer))
        if end > start
    )
    starts = [s for s, _, _ in spans]
    reach = list(itertools.accumulate((e for _, e, _ in spans), max))  # the furthest end of any span so far
    found = {}
    for i, array in enumerate(arrays):
        if not isinstance(array, torch.Tensor):
            continue
        start, end = _span(array)
        ids = set()
        j = bisect.bisect_left(starts, end) - 1  # spans starting before this array ends ...
        while j >= 0 and reach[j] > start:  # ... of which some may still reach into it
            if spans[j][1] > start:
                ids.add(spans[j][2])
            j -= 1
        if ids and end > start:
            found[i] = frozenset(ids)
    return found


def install_hook() -> None:
    """Register the global optimizer step pre-hook, once per process."""
    global _hook
    with _lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_before_step)


def stepped_in_graphs(owned: dict[int, frozenset[int]]) -> list[int]:
    """Return the arrays of owned that an optimizer owns whose step was captured into a CUDA graph.

    A graph's replay runs no pre-hook: a lazy copy of these could not hold their step back.
    """
    captured = {id(o) for o in list(_captured)}
    return [i for i, ids in owned.items() if ids & captured]


def _capturing() -> bool:
    """Say whether this thread's current CUDA stream is capturing a graph (never true where CUDA is not in use)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _known.add(optimizer)
    if _capturing():
        _captured.add(optimizer)  # its replays will step without this hook: its later lazy saves copy at the call
    with _lock:
        running = list(_running)
    for copy in running:
        copy.wait_for(id(optimizer))


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for state in list(optimizer.state.values()):
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """Return the addresses [start, end) of the bytes a tensor may touch (a DTensor: its shard on this rank)."""
    local = getattr(tensor, "_local_tensor", None)
    t = local if local is not None else tensor
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    if t.is_contiguous():  # nearly every tensor: its bytes in one run, found without a loop in Python
        return start, start + t.nbytes
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + extent * t.element_size()


def run_beside(daemon: DaemonClient, widen: bool = False) -> None:
    """Move the calling thread, as it starts, onto the CPUs the daemon runs on ([node] cpus).

    The lazy thread moves there: the background copy takes the daemon's cores, not the trainer's.
    The copy threads of a save widen theirs (widen=True) to the trainer's and the daemon's: while
    save_async blocks, the trainer waits and the daemon is idle, so the copy may use both. Where this
    process may not run there (a container's cpuset), or the daemon does not say, the thread stays.
    """
    try:
        cpus = set(daemon.status()["cpus"])
        if widen:
            cpus |= os.sched_getaffinity(0)
        if cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)  # 0: this thread
    except (CheckpointError, OSError, KeyError, TypeError, ValueError) as e:
        log.debug("ckpt: a copy thread stays on this process's CPUs: %s", e)


class DeviceArrays(Protocol):
    """The CUDA part of a lazy save (ckpt.cuda_staging.DeviceCopy), seen from here without importing CUDA code."""

    def run(self) -> None: ...

    def before_step(self, indices: list[int]) -> None: ...


class LazyCopy:
    """The owned arrays of one save, copied group by group on the lazy thread, then committed."""

    def __init__(self, owned: dict[int, frozenset[int]], on_device: frozenset[int] = frozenset()) -> None:
        """owned: {array index: ids of its optimizers}; on_device: the owned indices that are CUDA arrays."""
        by_owners: dict[frozenset[int], list[int]] = {}
        for index, ids in owned.items():
            by_owners.setdefault(ids, []).append(index)
        self.groups = [
            _Group(ids, [i for i in indices if i not in on_device], [i for i in indices if i in on_device])
            for ids, indices in by_owners.items()
        ]
        self.device: DeviceArrays | None = None  # set by the saver before run(), when on_device is not empty
        self.done = threading.Event()
        self.error: BaseException | None = None
        with _lock:
            _running.add(self)

    def run(self, copy: Callable[[list[int]], None], commit: Callable[[], None], release: Callable[[], None]) -> None:
        """Copy each group's host arrays with copy(indices), then the CUDA arrays, commit(), and always release().

        On the lazy thread. Errors are kept for wait(). release() (of the slot's writer lock) runs before done is set.
        """
        try:
            for group in self.groups:
                if group.host:
                    copy(group.host)
                group.host_copied.set()
            if self.device is not None:
                self.device.run()
            commit()
        except BaseException as e:
            self.error = e
        finally:
            for group in self.groups:
                group.host_copied.set()  # a copy that failed holds no optimizer back: the save fails instead
            with _lock:
                _running.discard(self)
            try:
                release()
            finally:
                self.done.set()

    def abandon(self, error: BaseException) -> None:
        """Give up a copy that could not be started (the saving thread): no optimizer waits for it."""
        self.error = error
        for group in self.groups:
            group.host_copied.set()
        with _lock:
            _running.discard(self)
        self.done.set()

    def wait_for(self, optimizer_id: int) -> None:
        """Return once the optimizer may step: its host arrays copied, its stream ordered after its CUDA copies."""
        for group in self.groups:
            if optimizer_id not in group.owners:
                continue
            if group.on_device and self.device is not None:
                self.device.before_step(group.on_device)
            group.host_copied.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the copy and the commit; return whether they finished (raise what failed)."""
        if not self.done.wait(timeout):
            return False
        if self.error is not None:
            raise self.error
        return True


@dataclass
class _Group:
    """The owned arrays of the same optimizers: those in host memory and those on a GPU."""

    owners: frozenset[int]
    host: list[int]
    on_device: list[int]
    host_copied: threading.Event = field(default_factory=threading.Event)
