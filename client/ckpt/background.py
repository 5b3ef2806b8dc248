"""BackgroundThread: work run in order on one daemon thread (slot prefaults, Lightning's torch files)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class BackgroundThread:
    """Run work in the order it is given on one daemon thread, started by the first submit.

    A daemon thread, unlike ThreadPoolExecutor's: work ahead of a save (mapping and pinning
    a slot) must never keep a process alive, nor outlive a Checkpointer that nobody closed
    (a Lightning plugin whose teardown is never called). close() finishes the work given
    and ends the thread; submit() after it raises RuntimeError.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, work: Callable[..., None], *args: Any) -> Future[None]:
        """Queue work(*args) behind the work given before; return its future."""
        future: Future[None] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            self._work.put((future, lambda: work(*args)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return future

    def close(self) -> None:
        """Finish the work given, end the thread and wait for it."""
        with self._lock:
            self._closed, thread = True, self._thread
            if thread is not None:
                self._work.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, work = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                work()
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(None)
