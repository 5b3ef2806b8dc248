"""Speak systemd's notify protocol (READY, WATCHDOG, STOPPING) with no extra dependency."""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send one notification to $NOTIFY_SOCKET; return False when not run under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError:
        return False  # the service manager went away; serving goes on regardless
    return True


def watchdog_interval_s() -> float | None:
    """Return how often to send WATCHDOG=1 (half of $WATCHDOG_USEC), or None when not asked to."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
