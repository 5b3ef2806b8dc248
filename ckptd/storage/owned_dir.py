"""Make the directories the daemon owns, or take over existing ones only if no other user could have prepared them.

The names of the daemon's directories are known in advance (/dev/shm/ckptd-UID-..., /tmp/ckptd-UID,
a documented /dev/shm/ckptd): another local user could make one first and read what is staged
in it, or plant files and links the daemon would trust. claim_dir makes a directory with mkdir
at an explicit mode (the umask decides nothing), or accepts an existing one only where
ckpt_core.owned_paths.dir_problem finds nothing wrong; otherwise it raises UnsafePath, and
`ckptd serve` exits 2. Files in those directories are opened with O_NOFOLLOW (create_new,
read_owned; durable_write for the NVMe tier), new ones with O_EXCL.

Callers: daemon._claim_socket (event loop, at start), root_lock.hold (the NVMe root),
root_identity.claim (the staging directory), Node (the replica root) and SlotPool (job
directories in the staging directory), all on worker threads. Calls block on the disk.
"""

from __future__ import annotations

import grp
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ckpt_core.errors import InvalidArgument
from ckpt_core.owned_paths import dir_problem, user_name

DIR_MODE = 0o750  # the NVMe tier's directories: the daemon's group reads checkpoints straight from them
FILE_MODE = 0o640  # shards and records, wherever the daemon keeps them


class UnsafePath(OSError):
    """A path the daemon would use could have been prepared by another user: refused, never read or written."""


@dataclass(frozen=True)
class StagingAccess:
    """Who besides the daemon's user uses the staging directory: nobody, or the members of [staging] group.

    The group's members (training ranks of other users) open and map the slots read-write;
    nobody but the daemon makes files there, so the directory is never group-writable.
    """

    gid: int | None = None

    @classmethod
    def of_group(cls, group: str) -> StagingAccess:
        """Return the access [staging] group names (a name or a gid; empty: the daemon's user alone).

        Raises InvalidArgument for a name this machine does not know (`ckptd serve` exits 2).
        """
        if not group:
            return cls()
        if group.isdigit():
            return cls(int(group))
        try:
            return cls(grp.getgrnam(group).gr_gid)
        except KeyError:
            raise InvalidArgument(f"config key staging.group: there is no group {group!r} on this machine") from None

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o750

    @property
    def slot_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    MARKER_MODE = 0o600  # the markers beside the slots: read by the daemon (and offline tools run as root) only


OWNER_ONLY = StagingAccess()  # no [staging] group


def claim_dir(
    path: Path, mode: int, what: str, key: str, gid: int | None = None, group_may_write: bool = False
) -> None:
    """Make path (mode, group gid) if it is missing, or accept it only if it is sound; raise UnsafePath otherwise.

    Missing parents are made as mkdir -p would: they are not the daemon's to check. what and key
    name the directory and its config key in the message ("the staging directory", "staging.dir").
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        problem = dir_problem(path, {os.geteuid()}, group_may_write=group_may_write or gid is not None)
        if problem is not None:
            raise UnsafePath(
                f"refusing {what} {path} ({key}): {problem}. Another local user may have made it to read or plant "
                "what the daemon keeps there; nothing was read from it or written to it. Remove it (or give it to this "
                f"daemon's user, uid {os.geteuid()}, without write access for others) and start again"
            ) from None
        return
    os.chmod(path, mode)  # mkdir's mode passed through the umask
    if gid is not None and gid != os.getegid():
        os.chown(path, -1, gid)


def create_new(path: Path, mode: int, flags: int = os.O_WRONLY, gid: int | None = None) -> int:
    """Create a file that was not there (O_EXCL, never through a link) with exactly mode; return its descriptor."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # open's mode passed through the umask
        if gid is not None and gid != os.getegid():
            os.fchown(fd, -1, gid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_owned(path: Path, flags: int, owner: int | None = None) -> int:
    """Open an existing regular file owned by owner (default: this process's user), never through a link."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # O_NONBLOCK: a planted FIFO
    try:
        refusal = file_problem(path, os.fstat(fd), os.geteuid() if owner is None else owner)
        if refusal is not None:
            raise UnsafePath(refusal)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_owned(path: Path, owner: int | None = None) -> bytes:
    """Return the bytes of a regular file owned by owner (default: this process's user), never read through a link."""
    fd = open_owned(path, os.O_RDONLY, owner)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def file_problem(path: Path, st: os.stat_result, owner: int) -> str | None:
    """Say why a file found in one of the daemon's directories is not its own to use, or None where it is."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != owner:
        return f"{path} belongs to {user_name(st.st_uid)}, not to uid {owner}"
    return None
