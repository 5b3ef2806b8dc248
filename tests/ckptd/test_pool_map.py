"""One call's items on a shared pool: its own bound at once, results in order, every item ended before it returns."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptd.pool_map import pool_map


def test_a_call_keeps_to_its_own_bound_on_a_larger_shared_pool_and_answers_in_order():
    running = peak = 0
    lock = threading.Lock()

    def item(n: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)  # long enough for the items to overlap
        with lock:
            running -= 1
        return n * n

    with ThreadPoolExecutor(16) as shared:
        assert list(pool_map(shared, item, range(12), at_once=3)) == [n * n for n in range(12)]
    assert peak == 3


def test_a_failed_item_raises_only_once_every_item_submitted_has_ended():
    # A ranged read's items write into its caller's buffer: none may still run when the call has raised.
    ended: list[int] = []
    slow_started = threading.Event()

    def item(n: int) -> int:
        if n == 0:
            slow_started.wait(5)
            raise OSError("the store went away")
        slow_started.set()
        time.sleep(0.2)
        ended.append(n)
        return n

    with ThreadPoolExecutor(4) as shared:
        with pytest.raises(OSError, match="went away"):
            list(pool_map(shared, item, range(3), at_once=3))
        assert sorted(ended) == [1, 2]
