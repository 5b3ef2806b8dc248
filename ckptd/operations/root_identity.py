"""Tie the staging slots to the NVMe root they were taken for, and notice when that root is gone.

The root carries a random identity in ROOT_ID_NAME, written at its first start; the
staging directory keeps a copy. Node (the composition root) calls claim() at start-up, on a worker thread,
before the slots are recovered. claim() makes the staging directory, or takes over one only
another user could not have prepared (owned_dir.claim_dir: the daemon exits 2 on any other).
Slots found beside another root's identity were taken for
a root that was deleted, wiped or replaced, and are removed, never flushed into this one.
Their steps belong to another history: a job started again on a fresh root would resume
from them. While the daemon runs, daemon.serve awaits watch() (Node.watch_root), which returns once the
root no longer carries its identity; the daemon then gives its staging memory back with
remove_slots() and stops (daemon.serve).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import uuid
from concurrent.futures import Executor
from pathlib import Path

from ckptd.storage.durable_write import replace_file
from ckptd.storage.owned_dir import OWNER_ONLY, StagingAccess, UnsafePath, claim_dir, read_owned

log = logging.getLogger(__name__)

ROOT_ID_NAME = ".ckptd-root"
CHECK_S = 5.0


def identity(root: Path) -> str | None:
    """Return the identity a root carries, None if it carries none (or is not there)."""
    try:
        return (root / ROOT_ID_NAME).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def claim(root: Path, staging: Path, access: StagingAccess = OWNER_ONLY) -> str:
    """Give root an identity if it has none, tie staging to it (removing another root's slots); return it.

    Raises UnsafePath when staging could have been prepared by another user: it is not used, whatever it holds.
    """
    ident = identity(root)
    if ident is None:
        ident = uuid.uuid4().hex
        replace_file(root / ROOT_ID_NAME, ident.encode())
    claim_dir(staging, access.dir_mode, "the staging directory", "staging.dir", gid=access.gid)
    marker = staging / ROOT_ID_NAME
    try:
        tied: str | None = read_owned(marker).decode().strip()
    except FileNotFoundError:
        tied = None  # a new staging directory, or one from before identities: its slots are this root's
    except (OSError, UnicodeDecodeError) as e:  # a link, not ours, or garbage: its slots are not this root's
        if isinstance(e, OSError) and not isinstance(e, UnsafePath) and e.errno != errno.ELOOP:
            raise  # a passing failure (EIO, EMFILE) says nothing of whose slots these are: never a reason to wipe them
        log.warning("ignoring the staging directory's identity marker %s: %s", marker, e)
        with contextlib.suppress(OSError):  # the name only: unlink follows no link
            marker.unlink()
        tied = ""
    if tied == ident:
        return ident
    if tied is not None:
        count, size = remove_slots(staging)
        if count:
            log.warning(
                "removed %d staging files (%d bytes) in %s: they were taken for another NVMe root than %s "
                "(deleted, wiped or replaced), and are not flushed into this one",
                count, size, staging, root,
            )  # fmt: skip
    replace_file(marker, ident.encode(), access.MARKER_MODE)
    return ident


def remove_slots(staging: Path) -> tuple[int, int]:
    """Remove every job's slots from a staging directory; return (files, bytes) removed."""
    count = size = 0
    for job_dir in [p for p in staging.iterdir() if p.is_dir() and not p.is_symlink()] if staging.is_dir() else []:
        for path in job_dir.iterdir():
            count += 1
            size += path.lstat().st_size
        shutil.rmtree(job_dir, ignore_errors=True)
    return count, size


async def watch(root: Path, ident: str, threads: Executor) -> None:
    """Return once root no longer carries ident (checked every CHECK_S on threads: Executors.status)."""
    while True:
        await asyncio.sleep(CHECK_S)  # a period: nothing tells a process that a directory was removed
        try:
            if await asyncio.get_running_loop().run_in_executor(threads, identity, root) != ident:
                return
        except OSError as e:  # unreadable for now (EIO, EACCES): not the same as gone
            log.warning("cannot read the identity of the NVMe root %s: %s", root, e)
