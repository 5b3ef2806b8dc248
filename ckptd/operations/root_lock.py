"""Keep one daemon per NVMe root: a lock on the root, held for the daemon's whole life.

Two daemons on one root would undo each other: start-up removes the temporary files the
other's flushes are writing, retention removes steps the other is sealing. daemon.serve
calls hold() at start-up, before Node prepares the disk (cleanup, retention), and releases
the lock once it drained. The lock is an flock on LOCK_NAME in the root, which names its
holder (pid and socket) for the message a second daemon stops with; the kernel drops it
when the holder's process ends, however it ends, so a daemon killed leaves no stale lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from ckpt_core.errors import InvalidArgument

from ckptd.storage.owned_dir import DIR_MODE, FILE_MODE, UnsafePath, claim_dir

log = logging.getLogger(__name__)

LOCK_NAME = ".ckptd-lock"
HOLDER_MAX_BYTES = 4096


class RootInUse(Exception):
    """Another daemon holds the NVMe root (a config problem: give each daemon a root of its own)."""


class RootLock:
    """The lock on one NVMe root, held from hold() until release()."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Let another daemon have the root (idempotent); the lock file stays, naming nobody who holds it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def hold(root: Path, socket_path: Path) -> RootLock:
    """Create root if missing and lock it for this process; name this process and its socket in the lock file.

    Blocks on the disk: call it from a worker thread. Raises InvalidArgument naming node.root
    when the root cannot be written (read-only, not a directory, no permission), UnsafePath when
    it is not this user's (owned_dir; a link to a directory is followed: the operator's choice),
    RootInUse naming the holder's pid and socket when another daemon holds it.
    """
    path = root / LOCK_NAME
    missing = not os.path.lexists(root)
    try:
        # The group may write: roots made under the unit's former UMask=0007 are 0770.
        claim_dir(root.resolve(), DIR_MODE, "the NVMe root", "node.root", group_may_write=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    except UnsafePath:
        raise
    except OSError as e:
        raise InvalidArgument(f"config key node.root: cannot write the NVMe root {root}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, FILE_MODE)  # open's mode passed through the umask; another daemon's lock is left alone
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RootInUse(
            f"the NVMe root {root} (node.root) is in use by another ckptd ({holder}): one daemon per root; "
            "give this one a root of its own"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    if missing:  # created, not refused: a first start on the embedded defaults or on a fresh disk needs it
        log.warning(
            "node.root %s did not exist: created it. If it is meant to be on a disk that should be mounted, "
            "that disk is not mounted and checkpoints land on the filesystem below it",
            root,
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "socket": str(socket_path)}).encode() + b"\n", 0)
    return RootLock(path, fd)


def _holder(fd: int) -> str:
    """Say who holds the lock, from what it wrote in the lock file (it may not have written it yet)."""
    try:
        holder = json.loads(os.pread(fd, HOLDER_MAX_BYTES, 0))
        return f"pid {int(holder['pid'])}, socket {holder['socket']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid and socket not written yet"
