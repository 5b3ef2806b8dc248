"""Copy a flattened state into a shared-memory staging slot: the one copy save_async waits for.

Slots are files the daemon hands out; each is mapped once (pages populated up
front) and reused by later saves. CUDA tensors go through ckpt.cuda_staging.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from ckpt_core.errors import InvalidArgument

from ckpt.background import BackgroundThread
from ckpt.flatten import Flattened

PARALLEL_MIN_BYTES = 64 << 20


class SlotMappings:
    """Keep each staging slot mapped across saves, so its pages are faulted in only once.

    get() may be called from the saving thread and, through prefault(), from one
    background thread; calls for the same slot wait for each other.
    """

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._background = BackgroundThread("ckpt-prefault")

    def prefault(self, path: str, size_bytes: int, pin_on: int | None = None) -> Future[None]:
        """Map a slot (and with pin_on, a GPU's index, register it with CUDA) in the background, ahead of its save."""
        return self._background.submit(self.map_ahead, path, size_bytes, pin_on)

    def in_background(self, work: Callable[[], None]) -> Future[None]:
        """Run work on the background thread, after the prefaults asked before it (Checkpointer.prepare)."""
        return self._background.submit(work)

    def map_ahead(self, path: str, size_bytes: int, pin_on: int | None) -> None:
        """Map a slot (and with pin_on, register it with CUDA) now, on the calling thread: the background's work."""
        with self._lock_for(path):  # held while pinning too: a save that maps the slot anew waits, never unpins first
            held = self._maps.get(path)  # mapped already by a save, maybe at another size: keep that
            try:
                slot = held[1] if held is not None else self._get(path, size_bytes)
            except OSError:  # the slot was dropped meanwhile: the next save maps what it gets
                return
            if pin_on is not None:
                from ckpt import cuda_staging

                cuda_staging.leave_captures_alone()  # the prefault thread: a trainer's graph capture goes on
                cuda_staging.pin(slot, pin_on)

    def _lock_for(self, path: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(path, threading.Lock())

    def mapped(self, path: str, size_bytes: int) -> bool:
        """Say whether the slot is mapped already at this size (its file unchanged): get() will not fault it in."""
        held = self._maps.get(path)
        return held is not None and held[0] == (*_file_identity(path), size_bytes)

    def get(self, path: str, size_bytes: int) -> torch.Tensor:
        """Return a uint8 tensor over the whole slot file, mapping it again if the file changed."""
        self._drop_vanished()
        with self._lock_for(path):
            return self._get(path, size_bytes)

    def _drop_vanished(self) -> None:
        # The daemon may drop a slot to stay within its budget: unmap it, or its memory lingers.
        for path, (identity, tensor) in list(self._maps.items()):
            gone = _file_identity(path) != identity[:2]
            if gone and self._maps.get(path, (None,))[0] == identity:
                del self._maps[path]
                _forget(tensor)

    def _get(self, path: str, size_bytes: int) -> torch.Tensor:
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino, size_bytes)
            held = self._maps.get(path)
            if held is not None and held[0] == identity:
                return held[1]
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(fd, size_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        tensor = torch.frombuffer(m, dtype=torch.uint8, count=size_bytes)  # keeps m mapped while it lives
        if held is not None:
            _forget(held[1])
        self._maps[path] = (identity, tensor)
        return tensor

    def close(self) -> None:
        """Drop every mapping (each is unmapped once no tensor uses it)."""
        self._background.close()
        for _, tensor in self._maps.values():
            _forget(tensor)
        self._maps.clear()


def _file_identity(path: str) -> tuple[int, ...]:
    """Return (device, inode) of a slot file, or () once it is gone: a slot the daemon dropped or made anew."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ()
    return st.st_dev, st.st_ino


def _forget(slot: torch.Tensor) -> None:
    cuda_staging = sys.modules.get("ckpt.cuda_staging")  # loaded only if this process staged CUDA tensors
    if cuda_staging is not None:
        cuda_staging.unregister(slot)


@contextlib.contextmanager
def writer_lock(path: str, who: str) -> Iterator[None]:
    """Hold the slot's writer lock while copying into it: the daemon never hands a locked slot to another save."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidArgument(
                f"{who} is being saved by another live process; each rank of a job must be one process"
            ) from None
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a child forked meanwhile shares the descriptor
        os.close(fd)


def copy_into(
    flat: Flattened,
    slot: torch.Tensor,
    pool: ThreadPoolExecutor,
    threads: int = 2,
    only: Collection[int] | None = None,
    ready: dict[int, Any] | None = None,
) -> None:
    """Copy flat's arrays (those at the indices in only, if given) into slot, on up to threads threads; then return.

    ready: the save's events on the caller's CUDA streams (cuda_staging.ready_events, recorded on the
    saving thread); without them, they are recorded now, so the caller must be the saving thread.
    """
    wanted = None if only is None else frozenset(only)  # a list would make this loop quadratic in the tensors
    cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
    host: list[tuple[Any, Any]] = []
    for i, (array, entry) in enumerate(zip(flat.arrays, flat.entries, strict=True)):
        nbytes = entry["nbytes"]
        if nbytes == 0 or (wanted is not None and i not in wanted):
            continue
        if isinstance(array, np.ndarray):
            dst_bytes = slot[entry["offset"] : entry["offset"] + nbytes]
            host.append((np.ndarray(array.shape, dtype=array.dtype, buffer=dst_bytes.numpy()), array))
        else:
            (cuda if array.is_cuda else host).append((slot_view(flat, slot, i), array))
    if cuda:
        from ckpt import cuda_staging

        cuda_staging.copy_from_device(
            cuda, slot, ready if ready is not None else cuda_staging.ready_events(flat.arrays)
        )
    if threads > 1 and sum(_nbytes(src) for _, src in host) >= PARALLEL_MIN_BYTES and len(host) > 1:
        # Several streams of copies keep the memory channels busy; each copy_ drops the GIL.
        groups: list[list[tuple[Any, Any]]] = [[] for _ in range(threads)]
        loads = [0] * threads
        for pair in sorted(host, key=lambda p: -_nbytes(p[1])):
            i = loads.index(min(loads))
            groups[i].append(pair)
            loads[i] += _nbytes(pair[1])
        for f in [pool.submit(_copy_all, g) for g in groups if g]:
            f.result()
    else:
        _copy_all(host)


def slot_view(flat: Flattened, slot: torch.Tensor, index: int) -> torch.Tensor:
    """Return the slot's bytes of a tensor of flat, viewed with its dtype and shape (where its copy goes)."""
    array, entry = flat.arrays[index], flat.entries[index]
    assert isinstance(array, torch.Tensor), "a numpy array's copy goes through its own buffer view"
    return slot[entry["offset"] : entry["offset"] + entry["nbytes"]].view(array.dtype).view(array.shape)


def _nbytes(a: Any) -> int:
    return int(a.nbytes) if isinstance(a, np.ndarray) else a.numel() * a.element_size()


def _copy_all(pairs: list[tuple[Any, Any]]) -> None:
    for dst, src in pairs:
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src, casting="no")
        else:
            dst.copy_(src.detach())
