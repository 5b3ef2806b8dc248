"""ckptd speaks systemd's notify protocol: READY once serving, WATCHDOG from the loop, STOPPING on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_ready_watchdog_and_stopping_reach_a_real_notify_socket(make_daemon):
    daemon = make_daemon()
    notify_path = daemon.base / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(30)
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--config", str(daemon.config_path)],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        try:
            seen: list[str] = []
            while seen.count("WATCHDOG=1") < 3:  # pings keep coming, every 0.1 s
                seen.extend(notify.recv(4096).decode().split("\n"))
            assert "READY=1" in seen and seen.index("READY=1") < seen.index("WATCHDOG=1")
            proc.send_signal(signal.SIGTERM)
            while "STOPPING=1" not in seen:
                seen.extend(notify.recv(4096).decode().split("\n"))
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait()
