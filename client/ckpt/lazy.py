"""The lazy snapshot of save_async(lazy=True): what an optimizer owns is copied while training goes on.

Checkpointer.save_async(lazy=True), on the training thread, calls owners() to find the
arrays of the flattened state whose bytes overlap a known optimizer's parameters or
states, copies every other array into the slot at once, and hands a LazyCopy of the owned
ones to its lazy thread. That thread runs LazyCopy.run(): the owned arrays, group by
group (a group: the arrays the same optimizers own), then the commit.

Before any optimizer steps, torch calls _before_step (a global optimizer step pre-hook,
installed once per process by the first lazy save): it waits, in every LazyCopy still
running, for the groups the stepping optimizer owns, so a step never changes a tensor
before its bytes are in the slot. SaveHandle.wait() and the rank's next save wait for the
whole copy. The hook never waits for the commit, only for copies, which need nothing
from the training thread.

The lazy thread starts with run_beside(): it moves onto the CPUs the daemon runs on ([node] cpus),
so the background copy takes the daemon's cores and leaves the trainer's alone.

Optimizers are known from a scan of the heap at the first lazy save, and from every step
any optimizer takes afterwards (the same hook records it). An optimizer not known yet
owns nothing: its tensors are copied at once, which is always safe.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ckpt.errors import CheckpointError
from ckpt.transport import DaemonClient
from ckpt.wire.v1 import ckptd_pb2 as pb

log = logging.getLogger("ckpt")

_known: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_running: set[LazyCopy] = set()
_lock = threading.Lock()
_hook: Any = None


def owners(arrays: list[Any]) -> dict[int, frozenset[int]]:
    """Return {index of an array: ids of the known optimizers whose tensors overlap its bytes} (training thread)."""
    install_hook()
    if not _known:
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


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _known.add(optimizer)
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
        cpus = set(json.loads(daemon.call("Status", pb.StatusRequest()).json)["cpus"])
        if widen:
            cpus |= os.sched_getaffinity(0)
        if cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)  # 0: this thread
    except (CheckpointError, OSError, KeyError, TypeError, ValueError) as e:
        log.debug("ckpt: a copy thread stays on this process's CPUs: %s", e)


class LazyCopy:
    """The owned arrays of one save, copied group by group on the lazy thread, then committed."""

    def __init__(self, owned: dict[int, frozenset[int]]) -> None:
        by_owners: dict[frozenset[int], list[int]] = {}
        for index, ids in owned.items():
            by_owners.setdefault(ids, []).append(index)
        self.groups = [(ids, indices, threading.Event()) for ids, indices in by_owners.items()]
        self.done = threading.Event()
        self.error: BaseException | None = None
        with _lock:
            _running.add(self)

    def run(self, copy: Callable[[list[int]], None], commit: Callable[[], None], release: Callable[[], None]) -> None:
        """Copy each group with copy(indices), commit(), and always release(); on the lazy thread.

        Errors are kept for wait(). release() (of the slot's writer lock) runs before done is set.
        """
        try:
            for _, indices, copied in self.groups:
                copy(indices)
                copied.set()
            commit()
        except BaseException as e:
            self.error = e
        finally:
            for _, _, copied in self.groups:
                copied.set()  # a copy that failed holds no optimizer back: the save fails instead
            with _lock:
                _running.discard(self)
            try:
                release()
            finally:
                self.done.set()

    def wait_for(self, optimizer_id: int) -> None:
        """Return once every array the optimizer owns is copied (the optimizer step pre-hook)."""
        for ids, _, copied in self.groups:
            if optimizer_id in ids:
                copied.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the copy and the commit; return whether they finished (raise what failed)."""
        if not self.done.wait(timeout):
            return False
        if self.error is not None:
            raise self.error
        return True
