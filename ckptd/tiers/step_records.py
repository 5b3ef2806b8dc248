"""Read the records of a local tier's step directories, each file parsed once and then known by its identity.

A step directory holds a commit record (COMMIT.json) and one shard record per rank
(rank-NNNNN.meta.json). Peers ask for a step's holdings every few seconds, and
every listing of complete steps reads each step's commit state (a shard record
carries the whole tensor table), so each file is read and parsed once, then kept
while its identity (inode, size, mtime) stays the same. LocalDirTier calls
StepRecords on whichever thread calls the tier (flush, upload, peering and locator
threads); each entry is replaced whole, so two threads at worst parse one file twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from ckpt_core.commit_keys import CommitKeys
from ckpt_core.errors import CheckpointError, CorruptCheckpoint
from ckpt_core.format import COMMIT_NAME, CommitRecord, ShardMeta, digest, meta_name
from ckpt_core.history import line_text

from ckptd.cluster.placement import Holding
from ckptd.log_pace import LogPace

log = logging.getLogger(__name__)

Identity = tuple[int, int, int]  # (inode, size, mtime in ns): a file replaced or rewritten has another


class StepRecords:
    """Keep the parsed commit and shard records of the step directories of one tier."""

    def __init__(self, tier: str, commit_keys: CommitKeys) -> None:
        """commit_keys (Config.commit_keys): a commit record without a valid signature by one of them is damaged,
        a shard record without one is no holding."""
        self.tier = tier
        self.commit_keys = commit_keys
        self._commits: dict[Path, tuple[Identity, CommitRecord | str]] = {}
        self._holdings: dict[Path, tuple[Identity, Holding | None]] = {}

    def commit_state(self, step_dir: Path, job: str, step: int) -> CommitRecord | str:
        """Return the step's checked commit record, "missing", or "damaged"."""
        path = step_dir / COMMIT_NAME
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._commits.get(path)
        if cached is not None and cached[0] == identity:
            return cached[1]
        try:
            state: CommitRecord | str = CommitRecord.from_bytes(path.read_bytes(), str(path), self.commit_keys)
        except (CheckpointError, OSError) as e:
            log.error("%s step %d on tier %s has a damaged commit record: %s", job, step, self.tier, e)
            state = "damaged"
        self._commits[path] = (identity, state)
        return state

    def holdings(self, step_dir: Path, job: str, step: int, node: str = "") -> list[Holding]:
        """Return the readable shard records of a step, as held by node (a damaged one is logged and left out).

        With commit_keys that sign, a shard record not signed by one of them is left out too: a
        step is sealed (and its commit record signed) only from holdings, never from such a record.
        """
        found = []
        for name in sorted(entry_names(step_dir)):
            if not (name.startswith("rank-") and name.endswith(".meta.json")):
                continue
            path = step_dir / name
            try:
                st = path.stat()
                identity = (st.st_ino, st.st_size, st.st_mtime_ns)
                cached = self._holdings.get(path)
                if cached is None or cached[0] != identity:
                    cached = (identity, self._read_holding(path, job, step, name))
                    self._holdings[path] = cached
            except FileNotFoundError:
                continue  # replaced or removed since it was listed
            if cached[1] is not None:
                found.append(dataclasses.replace(cached[1], node=node))
        return found

    def learn(self, step_dir: Path, meta: ShardMeta) -> None:
        """Know a shard record just installed without reading it back (a large layout costs tens of ms to parse)."""
        path = step_dir / meta_name(meta.rank)
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        self._holdings[path] = ((st.st_ino, st.st_size, st.st_mtime_ns), self._holding(meta, meta.to_bytes()))

    def _holding(self, meta: ShardMeta, raw: bytes) -> Holding:
        tier = "peer" if self.tier == "peer" else "nvme"
        return Holding(
            "",
            tier,
            meta.job,
            meta.step,
            meta.rank,
            meta.world_size,
            meta.data_size_bytes,
            digest(raw),
            meta.run_id,
            line_text(meta.line),
            meta.saved_at,
        )

    def _read_holding(self, path: Path, job: str, step: int, name: str) -> Holding | None:
        try:
            raw = path.read_bytes()
            meta = ShardMeta.from_bytes(raw, str(path))
        except (CheckpointError, OSError) as e:
            log.error("ignoring damaged shard record %s: %s", path, e)
            return None
        if (meta.job, meta.step, meta_name(meta.rank)) != (job, step, name):
            log.error("ignoring shard record %s: it describes %s", path, meta_name(meta.rank))
            return None
        try:
            self.commit_keys.check(meta, str(path))
        except CorruptCheckpoint as e:
            if _unsigned_steps.due(path.parent):
                log.error("%s step %d on tier %s is not sealed from its shard records: %s", job, step, self.tier, e)
            return None
        return self._holding(meta, raw)

    def forget(self, step_dir: Path) -> None:
        """Drop what is kept of a step directory's records: the step is being removed."""
        self._commits.pop(step_dir / COMMIT_NAME, None)
        for path in [p for p in list(self._holdings) if p.parent == step_dir]:
            self._holdings.pop(path, None)


_unsigned_steps = LogPace()  # keyed by step directory: each of its ranks' records is refused alike
_listing_failures = LogPace()  # keyed by (directory, errno): out of descriptors, every peering round fails alike


def entry_names(directory: Path) -> list[str]:
    """List a directory's entries; an unreadable or missing one is logged (a minute apart) and counts as empty."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        if _listing_failures.due((directory, e.errno)):
            log.warning("cannot list %s: %s", directory, e)
        return []
