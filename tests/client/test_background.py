"""ckpt.background.BackgroundThread: work in order on one daemon thread, finished and ended by close()."""

from __future__ import annotations

import threading

import pytest
from ckpt.background import BackgroundThread


def test_work_runs_in_order_on_one_daemon_thread_started_by_the_first_submit():
    background = BackgroundThread("ckpt-test")
    assert not [t for t in threading.enumerate() if t.name == "ckpt-test"]  # nothing started yet
    gate, done, threads = threading.Event(), [], set()

    def work(i: int) -> None:
        gate.wait()
        done.append(i)
        threads.add((threading.current_thread().name, threading.current_thread().daemon))

    futures = [background.submit(work, i) for i in range(5)]
    gate.set()
    for f in futures:
        f.result(timeout=10)
    assert done == [0, 1, 2, 3, 4] and threads == {("ckpt-test", True)}
    background.close()


def test_a_failure_goes_to_its_future_and_the_work_after_it_still_runs():
    background = BackgroundThread("ckpt-test")

    def fail() -> None:
        raise OSError("disk full")

    failed, after = background.submit(fail), background.submit(lambda: None)
    with pytest.raises(OSError, match="disk full"):
        failed.result(timeout=10)
    assert after.result(timeout=10) is None
    background.close()


def test_close_finishes_the_work_given_and_ends_the_thread():
    background = BackgroundThread("ckpt-test")
    gate = threading.Event()
    slow = background.submit(gate.wait)
    queued = background.submit(lambda: None)
    threading.Timer(0.05, gate.set).start()
    background.close()
    assert slow.done() and queued.done()
    assert not [t for t in threading.enumerate() if t.name == "ckpt-test"]
    with pytest.raises(RuntimeError, match="ckpt-test is closed"):
        background.submit(lambda: None)
    background.close()  # twice is fine
