"""Locks and counts by key that hold an entry only while something uses it: tables that never grow.

The flusher serialises a rank's flushes, fetches and uploads serialise per shard, and
several roles count the steps they are working on (retention keeps off them). Each
used a dict of locks or counts that grew with every key ever seen; these two do the
same and drop a key once its last user is gone. A load's locate and retention's
removal of the same step exclude each other through SharedLocks (many locates at
once, a removal alone). Event loop only, but for ThreadKeyedLocks: the object tier
lists a job's steps in the store on worker threads, one listing of a job at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
L = TypeVar("L")


class KeyedLocks(Generic[K]):
    """One asyncio.Lock per key, held in first-come order, kept only while a task holds or waits for it."""

    def __init__(self) -> None:
        self._locks: _LocksInUse[K, asyncio.Lock] = _LocksInUse(asyncio.Lock)

    @contextlib.asynccontextmanager
    async def hold(self, key: K) -> AsyncIterator[None]:
        """Hold key's lock for the body (waiting behind earlier holders of the same key)."""
        lock = self._locks.join(key)
        try:
            async with lock:
                yield
        finally:
            self._locks.leave(key)

    def __len__(self) -> int:
        return len(self._locks)


class ThreadKeyedLocks(Generic[K]):
    """One threading.Lock per key, kept only while a thread holds or waits for it; any thread."""

    def __init__(self) -> None:
        self._guard = threading.Lock()  # over the table; a key's own lock is held outside it
        self._locks: _LocksInUse[K, threading.Lock] = _LocksInUse(threading.Lock)

    @contextlib.contextmanager
    def hold(self, key: K) -> Iterator[None]:
        """Hold key's lock for the body (blocking behind another thread holding the same key)."""
        with self._guard:
            lock = self._locks.join(key)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                self._locks.leave(key)

    def __len__(self) -> int:
        return len(self._locks)


class SharedLocks(Generic[K]):
    """Per key, any number of shared holders at once, or one holder alone that never waits; kept only while held.

    A shared holder waits while the key is held alone; one that would hold it alone takes it only if
    no one holds it now (else it is told so at once: the key is in use). So a shared holder may take
    the same key again inside its body (a locate whose fetch reads the step) without waiting on itself.
    """

    def __init__(self) -> None:
        self._shared: dict[K, int] = {}
        self._alone: set[K] = set()
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def shared(self, key: K) -> AsyncIterator[None]:
        """Hold key shared for the body, once no one holds it alone."""
        async with self._changed:
            await self._changed.wait_for(lambda: key not in self._alone)
            self._shared[key] = self._shared.get(key, 0) + 1
        try:
            yield
        finally:
            self._shared[key] -= 1
            if not self._shared[key]:
                del self._shared[key]

    @contextlib.asynccontextmanager
    async def alone_if_free(self, key: K) -> AsyncIterator[bool]:
        """Hold key alone for the body and yield True if no one holds it now; else yield False, holding nothing."""
        if key in self._alone or key in self._shared:
            yield False
            return
        self._alone.add(key)  # no await since the check: no one took it meanwhile
        try:
            yield True
        finally:
            async with self._changed:
                self._alone.discard(key)
                self._changed.notify_all()

    def __len__(self) -> int:
        return len(self._shared) + len(self._alone)


class _LocksInUse(Generic[K, L]):
    """key -> (its lock, users holding or waiting for it): a key comes with its first user, goes with its last."""

    def __init__(self, new_lock: Callable[[], L]) -> None:
        self._new_lock = new_lock
        self._locks: dict[K, tuple[L, int]] = {}

    def join(self, key: K) -> L:
        lock, users = self._locks.get(key) or (self._new_lock(), 0)
        self._locks[key] = (lock, users + 1)
        return lock

    def leave(self, key: K) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class KeyCounts(Generic[K]):
    """How many tasks are working on each key, kept only for keys with at least one."""

    def __init__(self) -> None:
        self._counts: dict[K, int] = {}

    @contextlib.contextmanager
    def counting(self, key: K) -> Iterator[None]:
        """Count key as worked on for the body."""
        self._counts[key] = self._counts.get(key, 0) + 1
        try:
            yield
        finally:
            self._counts[key] -= 1
            if not self._counts[key]:
                del self._counts[key]

    def keys(self) -> set[K]:
        """Return the keys being worked on now."""
        return set(self._counts)
