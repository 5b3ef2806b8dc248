"""Name, read and write the files of the staging slots: the bytes and the markers beside them.

    <dir>/<job>/rank-00000.slot-0               the bytes, mapped by client and daemon
    <dir>/<job>/rank-00000.slot-0.layout        written at commit: the shard's layout, as the client sent it
    <dir>/<job>/rank-00000.slot-0.pending.json  written next: which shard, its layout's checksum, run and commit time
    <dir>/<job>/rank-00000.slot-0.meta.json     written once checksummed: the shard's metadata

SlotPool (in staging) calls these: scan_slots from recover (on a flush thread, at
start-up), locked_by_a_writer on the event loop thread when a rank reserves a slot.
MemoryTier.from_directory calls scan_slots on the thread of the offline tool that reads the slots.
The markers are written whole with durable_write.replace_file.

Only the files of the staging directory's owner count: a job directory, slot or marker that is
a link, not a regular file, or another user's (planted, in a directory shared with a group) is
logged, its name removed (never followed), and nothing in it read or flushed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_core.errors import CheckpointError, CorruptCheckpoint
from ckpt_core.format import ShardMeta, digest, unseal, validate_job, validate_rank, validate_step
from ckpt_core.history import Line, line_from_json
from ckpt_core.owned_paths import user_name
from ckpt_core.shard_key import ShardKey

from ckptd.storage.owned_dir import read_owned

log = logging.getLogger(__name__)

SLOT_NAME = re.compile(r"rank-(\d{5})\.slot-(\d+)")
UNFLUSHED = frozenset({"pending", "flushing"})  # the states of a slot whose snapshot is on its way to NVMe


@dataclass
class Slot:
    """One shared-memory file and the snapshot it holds, if any."""

    path: Path
    job: str
    rank: int
    index: int
    size_bytes: int
    # allocating | free | writing | committing | pending (committed, flush not started: a newer save may replace it)
    # | flushing (picked by its job's flush round: pinned) | settled (flushed, or the flush failed)
    state: str = "free"
    shard: ShardKey | None = None
    data_size_bytes: int = 0
    layout_json: str = ""
    run_id: str = ""
    line: Line = ()  # the committed snapshot's line and time (Snapshot)
    saved_at: str = ""
    meta: ShardMeta | None = None  # set once checksummed: the memory tier can serve it
    reservation: int = 0  # the token of the current reservation; a stale one cannot commit
    committed_seq: int = 0  # order of commits across the pool: among two copies of a shard, the later wins
    allocating_bytes: int = 0  # the size being allocated, counted against the budget meanwhile
    committed_at_s: float = 0.0  # time.monotonic() at commit (or recovery): flush durations count from it

    @property
    def pending_path(self) -> Path:
        return self.path.with_name(self.path.name + ".pending.json")

    @property
    def layout_path(self) -> Path:
        return self.path.with_name(self.path.name + ".layout")

    @property
    def meta_path(self) -> Path:
        return self.path.with_name(self.path.name + ".meta.json")


def slot_path(directory: Path, job: str, rank: int, index: int) -> Path:
    """Name the shared-memory file of a rank's slot under a staging directory."""
    return directory / job / f"rank-{rank:05d}.slot-{index}"


def scan_slots(directory: Path) -> list[Slot]:
    """Read the slots under a staging directory with what each holds; damaged markers count as empty.

    Only its owner's regular files count (see the module's docstring): others are refused.
    """
    found: list[Slot] = []
    if not directory.is_dir():
        return found
    owner = os.stat(directory).st_uid
    for job_dir in _owned(sorted(directory.iterdir()), owner, stat.S_ISDIR):
        for path in _owned(sorted(job_dir.iterdir()), owner, stat.S_ISREG):
            m = SLOT_NAME.fullmatch(path.name)
            if not m:
                _remove_if_stray(path)
                continue
            slot = Slot(path, job_dir.name, int(m[1]), int(m[2]), path.stat().st_size)
            try:
                _load_markers(slot, owner)
            except (CheckpointError, OSError, KeyError, TypeError, ValueError) as e:
                log.warning("ignoring damaged staging record of %s: %s", path, e)
                slot.shard, slot.meta, slot.layout_json = None, None, ""
            found.append(slot)
    return found


def _owned(paths: list[Path], owner: int, kind: Callable[[int], bool]) -> list[Path]:
    """Return the paths that are owner's and of kind (lstat: a link is none); refuse links and others' files.

    The owner's own files of another kind (the root identity beside the job directories) are left alone.
    """
    kept = []
    for path in paths:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) and st.st_uid == owner:
            if kind(st.st_mode):
                kept.append(path)
            continue
        what = "link" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else "file"
        log.warning(
            "refusing %s in the staging directory: a %s of %s, mode %o (planted by another user?); never read, "
            "never flushed",
            path, what, user_name(st.st_uid), stat.S_IMODE(st.st_mode),
        )  # fmt: skip
        with contextlib.suppress(OSError):  # unlink and rmdir take the name: neither follows a link
            path.rmdir() if stat.S_ISDIR(st.st_mode) else path.unlink()
    return kept


MARKER_NAME = re.compile(r"(rank-\d{5}\.slot-\d+)\.(meta\.json|pending\.json|layout)(\.tmp)?")


def _remove_if_stray(path: Path) -> None:
    """Remove a marker left without its slot, or half written (a crash in replace_file): it holds nothing."""
    m = MARKER_NAME.fullmatch(path.name)
    if m and (m[3] or not path.with_name(m[1]).exists()):
        path.unlink(missing_ok=True)
        log.info("removed stray staging file %s", path)


def _load_markers(slot: Slot, owner: int) -> None:
    """Fill a slot from its markers (owner's regular files): the shard record if checksummed, else the commit marker."""
    pending = _marker(slot.pending_path, owner)
    record = unseal(pending, str(slot.pending_path)) if pending is not None else None
    if record is not None:
        slot.committed_seq = int(record.get("committed_ns", 0))
    if (meta_bytes := _marker(slot.meta_path, owner)) is not None:
        meta = ShardMeta.from_bytes(meta_bytes, str(slot.meta_path))
        slot.meta = meta
        slot.shard = ShardKey(meta.job, meta.step, meta.rank, meta.world_size)
        slot.data_size_bytes, slot.layout_json, slot.run_id = (
            meta.data_size_bytes,
            meta.layout_json,
            meta.run_id,
        )
        slot.line, slot.saved_at = meta.line, meta.saved_at
    elif record is not None:
        s = record["shard"]
        validate_rank(s["rank"], s["world_size"])
        slot.shard = ShardKey(validate_job(s["job"]), validate_step(s["step"]), s["rank"], s["world_size"])
        slot.data_size_bytes, slot.layout_json = int(record["data_size_bytes"]), _layout(slot, record, owner)
        slot.run_id = str(record.get("run_id", ""))
        slot.line = line_from_json(record.get("line", []), str(slot.pending_path))
        slot.saved_at = str(record.get("saved_at", ""))
    if slot.shard is not None and (slot.shard.job != slot.job or slot.shard.rank != slot.rank):
        raise ValueError("record names another job or rank")
    if slot.data_size_bytes > slot.size_bytes:
        raise ValueError("record is larger than the slot")


def _marker(path: Path, owner: int) -> bytes | None:
    """Return a marker's bytes, None if there is none; raise UnsafePath for one that is not owner's own file."""
    try:
        return read_owned(path, owner)
    except FileNotFoundError:
        return None


def _layout(slot: Slot, record: dict[str, Any], owner: int) -> str:
    """Return the layout a commit marker names: in its own file, checked (or, from older daemons, inside it)."""
    if "layout_json" in record:
        return str(record["layout_json"])
    layout = read_owned(slot.layout_path, owner)
    if digest(layout) != record["layout_xxh3_128"]:
        raise CorruptCheckpoint(f"{slot.layout_path}: does not match its commit marker")
    return layout.decode()


def locked_by_a_writer(path: Path) -> bool:
    """Say whether a live process holds the slot's writer lock (flock works across PID namespaces)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we got it
    return False
