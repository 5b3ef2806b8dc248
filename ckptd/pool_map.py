"""Map one call's items over a pool it was given, a bounded number at once, and wait for every one.

The roles whose calls ask many things at once (PeerInventory every peer's inventory, ObjectTier a
job's commit records and a shard's ranged GETs, StepShards every rank of a step) get their pool
from node.Executors at construction and call pool_map() on whatever thread calls them. Every item
has ended when pool_map() returns or raises, as when each call had a pool of its own: a ranged
read never writes into a buffer its caller was given back. The pool's size bounds the calls
together: calls made at once share it (each still at most at_once), where each used to have its own.
Only such leaf items run on these pools: an item that waited on its own pool could wait for ever once the pool is full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def pool_map(threads: Executor, fn: Callable[[T], R], items: Iterable[T], at_once: int) -> Iterator[R]:
    """Run fn on every item, at most at_once at a time on threads; return their results in order, once all ended.

    The results come as Executor.map gives them: the first failed item, in order, raises when reached.
    A single item runs on the calling thread.
    """
    items = list(items)
    if len(items) <= 1:
        return iter([fn(item) for item in items])
    futures: list[Future[R]] = []
    running: set[Future[R]] = set()
    try:
        for item in items:
            if len(running) >= at_once:
                running = wait(running, return_when=FIRST_COMPLETED).not_done
            future = threads.submit(fn, item)
            futures.append(future)
            running.add(future)
    finally:
        wait(futures)  # also when a submit failed (the pool shut down): what was started has ended
    return (future.result() for future in futures)
