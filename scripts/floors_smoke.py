"""Save and load through a real daemon from an environment holding only the client's dependencies.

scripts/check_floors.sh runs this with the client environment's Python (ckptd-client, torch,
grpcio, protobuf, numpy, xxhash at their floors) and the path of the daemon environment's
`ckptd` (installed without torch). It starts `ckptd serve`, waits for its READY=1, saves a
state, waits until it is durable on NVMe, loads it back bit for bit, and stops the daemon;
what it made (a temporary root, its staging directory in /dev/shm) is removed, also on failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ckpt
import torch

READY_TIMEOUT_S = 60.0


def main(ckptd: str) -> int:
    """Run the round trip against the daemon at path ckptd; return 0 when the state came back whole."""
    assert "ckptd" not in sys.modules and importable("ckptd") is False, "the client environment holds the daemon"
    work = Path(tempfile.mkdtemp(prefix="ckptd-floors-"))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-floors-", dir="/dev/shm"))
    notify_path = work / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    proc = None
    try:
        command = [ckptd, "serve", "--root", str(work / "nvme"), "--socket", str(work / "d.sock")]
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path)}
        with open(work / "ckptd.log", "wb") as log:
            proc = subprocess.Popen([*command, "--staging-dir", str(staging)], env=env, stdout=log, stderr=log)
        wait_ready(notify, proc, work)
        state = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(7)), "step": 3}
        with ckpt.Checkpointer(job="floors", rank=0, world_size=1, address=str(work / "d.sock")) as c:
            c.save_async(state, step=3).wait("nvme", timeout=60)
            loaded = c.load()
        assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"]), "the state did not come back whole"
        print(f"saved and loaded through {ckptd} with torch {torch.__version__}, ckpt {ckpt.__version__}")
        return 0
    finally:
        notify.close()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def importable(name: str) -> bool:
    """Say whether a module could be imported here, without importing it."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def wait_ready(notify: socket.socket, proc: subprocess.Popen[bytes], work: Path) -> None:
    """Return once the daemon says READY=1; raise with its log if it exits or never does."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    notify.settimeout(0.5)  # so that a daemon that exits at start-up is noticed
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ckptd exited with {proc.returncode}:\n{(work / 'ckptd.log').read_text()}")
        try:
            if b"READY=1" in notify.recv(4096):
                return
        except TimeoutError:
            continue
    raise RuntimeError(f"ckptd did not get ready within {READY_TIMEOUT_S} s:\n{(work / 'ckptd.log').read_text()}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
