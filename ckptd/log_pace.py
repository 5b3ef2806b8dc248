"""Keep a repeated refusal to one log line a minute per caller and kind, remembering a bounded number of them.

RequestGuard (refused requests), DataListener (refused TLS handshakes) and CoreLog (gRPC's own
lines) each keep one LogPace; due() is called on whichever thread logs, under the pace's lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable

LOG_EVERY_S = 60.0
MAX_KEYS_REMEMBERED = 1024


class LogPace:
    """Say whether a line about a key is due: the first time, and again once every_s has passed."""

    def __init__(self, every_s: float = LOG_EVERY_S, max_keys: int = MAX_KEYS_REMEMBERED) -> None:
        self.every_s = every_s
        self._max_keys = max_keys
        self._last_logged: OrderedDict[Hashable, float] = OrderedDict()  # key -> when it was last logged
        self._lock = threading.Lock()

    def due(self, key: Hashable) -> bool:
        """Return True (and note the time) if a line about key may be logged now."""
        now = time.monotonic()
        with self._lock:
            last = self._last_logged.get(key)
            if last is not None and now - last < self.every_s:
                return False
            self._last_logged[key] = now
            self._last_logged.move_to_end(key)
            while len(self._last_logged) > self._max_keys:
                self._last_logged.popitem(last=False)
            return True

    def __len__(self) -> int:
        return len(self._last_logged)
