"""The object tier: complete steps in an object store, in the layout of every tier.

`<url>/<job>/<step>/` holds each rank's `rank-NNNNN.data` (or, compressed,
`rank-NNNNN.data.zst` with its frame index `rank-NNNNN.frames.json`), then its
`rank-NNNNN.meta.json`, and last `COMMIT.json`. A step is listed only through its
commit record, which is written create-only after every rank's shard is there and
matches it. How a shard's bytes become those objects (names, parts, ranges, frames)
is object_layout's. Calls block: the daemon makes them from its threads, the CLI from its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt.format import COMMIT_NAME, INDEX_NAME, JOB_RE, CommitRecord, ShardMeta, data_name, digest, meta_name
from ckpt.shard_io import ShardSource
from ckpt.step_index import StepIndex, index_bytes

from ckptd.storage.commit_protocol import ObjectStepCommit
from ckptd.storage.object_store import ObjectStore
from ckptd.tiers.base import Tier
from ckptd.tiers.object_layout import (
    READ_THREADS,
    Piece,
    checked_frame_sizes,
    frame_groups,
    frame_index,
    frames_name,
    plain_pieces,
    range_bytes,
    read_parts,
    unpack_range,
    zstd_name,
)

log = logging.getLogger(__name__)

LISTING_TTL_S = 1.0
COMMIT_CHECK_THREADS = 32  # shard records read at once when a step is committed in the store


class CommitConflict(CheckpointError):
    """A commit record other than ours is already in the store: it stays, and the step is not ours to commit."""


class ObjectTier(Tier):
    """List, read, upload and remove steps in an object store."""

    name = "object"

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._records: dict[tuple[str, int], CommitRecord] = {}  # read once, kept while COMMIT.json is listed
        self._damaged_logged: set[str] = set()
        self._listings: dict[tuple[str, ...], tuple[float, Any]] = {}  # (job,) or (job, step)
        self._lock = threading.Lock()

    # -- listing ------------------------------------------------------------------

    def jobs(self) -> list[str]:
        found = [n for n, size in self._guarded(self.store.names).items() if size < 0 and JOB_RE.fullmatch(n)]
        return sorted(j for j in found if self.complete_steps(j))

    def _guarded(self, call: Any, *names: str) -> Any:
        try:
            return call(*names)
        except OSError as e:
            raise CheckpointError(f"object store {self.store.describe(*names)}: {e}") from e

    def _listed(self, key: tuple[str, ...], list_it: Any) -> Any:
        """Return a listing kept for LISTING_TTL_S (one pass of retention or a watcher lists once)."""
        cached = self._listings.get(key)
        if cached is not None and time.monotonic() - cached[0] < LISTING_TTL_S:
            return cached[1]
        found = list_it()
        with self._lock:
            self._listings[key] = (time.monotonic(), found)
        return found

    def _steps(self, job: str) -> list[int]:
        """Return the job's step numbers with anything in the store (one listing with a delimiter)."""

        def list_steps() -> list[int]:
            names = self._guarded(self.store.names, job)
            steps = sorted(int(n) for n, size in names.items() if size < 0 and n.isdigit() and str(int(n)) == n)
            with self._lock:
                for key in [k for k in self._records if k[0] == job and k[1] not in steps]:
                    del self._records[key]  # removed (by another node's retention, a lifecycle rule)
            return steps

        return list(self._listed((job,), list_steps))

    def step_names(self, job: str, step: int) -> dict[str, int]:
        """Return {name: size in bytes} of the objects of one step."""
        listed = self._listed((job, str(step)), lambda: self._guarded(self.store.names, job, str(step)))
        return {n: size for n, size in listed.items() if size >= 0}

    def _forget_listing(self, job: str) -> None:
        """Drop what is kept of the job's listings: this node just wrote to it."""
        with self._lock:
            for key in [k for k in self._listings if k[0] == job]:
                del self._listings[key]

    def all_steps(self, job: str) -> list[int]:
        """Return every step of the job with anything uploaded, complete or not, oldest first."""
        return self._steps(job)

    def complete_steps(self, job: str) -> list[int]:
        states = self._commit_states(job)
        return [s for s, state in states.items() if isinstance(state, CommitRecord)]

    def damaged_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is there but does not check."""
        return [s for s, state in self._commit_states(job).items() if state == "damaged"]

    def _commit_states(self, job: str) -> dict[int, CommitRecord | str]:
        """Return {step: its commit record, or "damaged"} for each step with a COMMIT.json, oldest first.

        One listing of the step names; then each record is read once (in parallel) and kept while listed."""
        steps = self._steps(job)
        with self._lock:  # other threads drop entries meanwhile (a listing, a removal)
            known = {s: self._records.get((job, s)) for s in steps}
        unread = [s for s, record in known.items() if record is None]
        states: dict[int, CommitRecord | str] = {s: r for s, r in known.items() if r is not None}
        # A commit record, once read, is kept; the others are asked for each time, in parallel.
        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="object-list") as pool:
            states.update(zip(unread, pool.map(lambda s: self._commit_state(job, s), unread), strict=True))
        return {s: state for s, state in sorted(states.items()) if state != "missing"}

    def _commit_state(self, job: str, step: int) -> CommitRecord | str:
        with self._lock:
            cached = self._records.get((job, step))
        if cached is not None:
            return cached
        where = self.store.describe(job, str(step), COMMIT_NAME)
        try:
            raw = self.store.read(job, str(step), COMMIT_NAME)
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            raise CheckpointError(f"object store {where}: {e}") from e
        try:
            record = CommitRecord.from_bytes(raw, where)
            if (record.job, record.step) != (job, step):
                raise CorruptCheckpoint(f"{where} describes {record.job} step {record.step}")
        except CheckpointError as e:
            if where not in self._damaged_logged:  # once: every listing reads it again
                self._damaged_logged.add(where)
                log.error("%s", e)
            return "damaged"
        with self._lock:
            self._records[(job, step)] = record
        return record

    def is_complete(self, job: str, step: int) -> bool:
        """Say whether a step is complete in the store, from its commit record read afresh: no listing."""
        with self._lock:  # not what is kept: another node's retention may have removed the step
            self._records.pop((job, step), None)
        return isinstance(self._commit_state(job, step), CommitRecord)

    def commit_record(self, job: str, step: int) -> CommitRecord:
        state = self._commit_state(job, step) if step in self._steps(job) else "missing"
        if not isinstance(state, CommitRecord):
            raise NotFound(f"{job} step {step} is not complete on tier object ({self.store.describe(job, str(step))})")
        return state

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        raise NotFound(f"rank {rank} shard of {job} step {step} is in the object store: read it with read_into")

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        return meta_name(rank) in self.step_names(job, step)

    # -- reading --------------------------------------------------------------------

    def _what(self, meta: ShardMeta) -> str:
        where = self.store.describe(meta.job, str(meta.step))
        return f"rank {meta.rank} shard of {meta.job} step {meta.step} on tier object ({where})"

    def read_meta(self, job: str, step: int, rank: int, record: CommitRecord | None = None) -> ShardMeta:
        """Return a rank's shard record, checked against the step's commit record (given, or the store's)."""
        record = record or self.commit_record(job, step)
        if rank >= record.world_size:
            raise NotFound(f"{job} step {step} has no rank {rank} (world_size {record.world_size})")
        where = self.store.describe(job, str(step), meta_name(rank))
        try:
            raw = self.store.read(job, str(step), meta_name(rank))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{where}: missing from a complete step") from None
        except OSError as e:
            raise CheckpointError(f"{where}: {e}") from e
        if digest(raw) != record.shard_meta_xxh3_128[rank]:
            raise CorruptCheckpoint(f"{where}: does not match the step's commit record")
        meta = ShardMeta.from_bytes(raw, where)
        if (meta.job, meta.step, meta.rank) != (job, step, rank):
            raise CorruptCheckpoint(f"{where}: describes rank {meta.rank} of {meta.job} step {meta.step}")
        return meta

    def read_index(self, record: CommitRecord) -> bytes | None:
        """Return the step's sealed index if the store keeps one that belongs to record."""
        where = self.store.describe(record.job, str(record.step), INDEX_NAME)
        try:
            data = self.store.read(record.job, str(record.step), INDEX_NAME)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(f"{where}: {e}") from e
        StepIndex.from_bytes(data, where).check(record, where)
        return data

    def read_into(self, meta: ShardMeta, buffer: memoryview, offset: int = 0, length: int = -1) -> None:
        """Fill buffer with the shard's bytes, fetched in parallel ranged GETs, every chunk checked.

        A range as in Tier.read_into: only the stored bytes (or compressed frames) that
        hold it are fetched.
        """
        what = self._what(meta)
        length = meta.data_size_bytes - offset if length < 0 else length
        names = self.step_names(meta.job, meta.step)
        if zstd_name(meta.rank) in names:
            frame_sizes = self._frame_sizes(meta, what)
            pieces = list(frame_groups(meta, frame_sizes, range_bytes(sum(frame_sizes)), offset, length))
            name = zstd_name(meta.rank)
        elif data_name(meta.rank) in names:
            if names[data_name(meta.rank)] != meta.data_size_bytes:
                size = names[data_name(meta.rank)]
                raise CorruptCheckpoint(f"{what}: {size} bytes stored, expected {meta.data_size_bytes}")
            pieces = plain_pieces(meta, offset, length)
            name = data_name(meta.rank)
        else:
            raise CorruptCheckpoint(f"{what}: data object missing")

        def fetch(piece: Piece) -> str | None:
            start, stored, frames = piece
            try:
                blob = self.store.read(meta.job, str(meta.step), name, start=start, end=start + stored)
            except OSError as e:  # the way to the store failed: not a bad byte
                raise CheckpointError(f"{what}: reading bytes {start}-{start + stored - 1} of {name}: {e}") from e
            return unpack_range(meta, blob, frames, buffer, compressed=name.endswith(".zst"), base=offset)

        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="object-read") as pool:
            for bad in pool.map(fetch, pieces):
                if bad is not None:
                    raise CorruptCheckpoint(f"{what}: {bad}")

    def _frame_sizes(self, meta: ShardMeta, what: str) -> list[int]:
        try:
            raw = self.store.read(meta.job, str(meta.step), frames_name(meta.rank))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{what}: the frame index of its compressed data is missing") from None
        except OSError as e:
            raise CheckpointError(f"{what}: {e}") from e
        return checked_frame_sizes(raw, meta, what)

    # -- writing ----------------------------------------------------------------------

    def holds(self, meta: ShardMeta) -> bool:
        """Say whether exactly this shard (record and data) is already uploaded."""
        if not self._has_data(meta, self.step_names(meta.job, meta.step)):
            return False
        try:
            return self.store.read(meta.job, str(meta.step), meta_name(meta.rank)) == meta.to_bytes()
        except FileNotFoundError:
            return False

    @staticmethod
    def _has_data(meta: ShardMeta, names: dict[str, int]) -> bool:
        """Say whether the listing holds the shard's record and its data in one format, of the right size."""
        rank = meta.rank
        plain = names.get(data_name(rank)) == meta.data_size_bytes
        compressed = zstd_name(rank) in names and frames_name(rank) in names
        return meta_name(rank) in names and plain != compressed

    def upload_shard(self, meta: ShardMeta, data_path: Path, compression: str) -> bool:
        """Upload one shard from a local data file, checking every chunk against meta as it is read.

        The data goes first, then (compressed) its frame index, then the shard record:
        a shard counts as uploaded once its record is there. A step complete in the
        store is never written to: if its commit record lists this very shard there is
        nothing to do (return False), else CommitConflict is raised.
        """
        job, step = meta.job, str(meta.step)
        self._forget_listing(job)
        state = self._commit_state(job, meta.step)  # asked of the store now, not of a listing kept a while
        listed = isinstance(state, CommitRecord) and meta.rank < state.world_size
        if listed and state.shard_meta_xxh3_128[meta.rank] == digest(meta.to_bytes()):  # type: ignore[union-attr]
            return False
        if state != "missing":
            raise CommitConflict(
                f"{self.store.describe(job, step)} has a commit record for other shards (or a damaged one); "
                "a complete step is never rewritten"
            )
        frame_sizes: list[int] = []
        parts = read_parts(meta, data_path, compression, frame_sizes, self._what(meta))
        store = self.store
        rank = meta.rank

        def data() -> Iterator[tuple[str, Iterator[bytes]]]:
            # One data format per shard: a reader takes either, so the other one goes first.
            if compression == "zstd":
                store.remove(job, step, data_name(rank))
                yield zstd_name(rank), parts
                yield frames_name(rank), iter([frame_index(frame_sizes)])  # written once the data is, its sizes known
            else:
                store.remove(job, step, frames_name(rank))
                store.remove(job, step, zstd_name(rank))
                yield data_name(rank), parts

        ObjectStepCommit(store, job, meta.step).put_shard(rank, data(), meta.to_bytes())
        self._forget_listing(job)
        return True

    def matching_records(self, record: CommitRecord) -> dict[int, ShardMeta]:
        """Return {rank: shard record} of the ranks whose shard in the store the record lists (read at once)."""
        job, step = record.job, str(record.step)
        names = self.step_names(job, record.step)
        present = [r for r in range(record.world_size) if meta_name(r) in names]

        def matching(rank: int) -> ShardMeta | None:
            try:
                raw = self.store.read(job, step, meta_name(rank))
                meta = ShardMeta.from_bytes(raw, meta_name(rank))
            except (FileNotFoundError, CheckpointError):
                return None
            ok = digest(raw) == record.shard_meta_xxh3_128[rank] and self._has_data(meta, names)
            return meta if ok else None

        with ThreadPoolExecutor(max_workers=COMMIT_CHECK_THREADS, thread_name_prefix="object-check") as pool:
            found = dict(zip(present, pool.map(matching, present), strict=True))
        return {r: meta for r, meta in found.items() if meta is not None}

    def try_commit(self, record: CommitRecord) -> bool:
        """Write the step's commit record, create-only, if every rank's shard is there and matches it.

        Return whether the step is now complete in the store with this record, False while ranks are
        missing. A record already there stays, even if it differs: CommitConflict (none replaces another's)."""
        self._forget_listing(record.job)
        names = self.step_names(record.job, record.step)  # asked on every poll: while a rank is missing, read nothing
        missing = any(meta_name(r) not in names for r in range(record.world_size))
        metas = {} if missing else self.matching_records(record)
        if len(metas) < record.world_size:
            return False
        job, step = record.job, str(record.step)
        where = self.store.describe(job, step, COMMIT_NAME)
        try:
            commit = ObjectStepCommit(self.store, job, record.step)
            self._put_index(commit, record, metas)
            created = commit.write_commit(record.to_bytes())
        except OSError as e:
            raise CheckpointError(f"object store {where}: {e}") from e
        finally:
            self._forget_listing(job)
        if created:
            log.info("%s step %s is complete on object (%s)", job, step, self.store.describe(job, step))
            return True
        if self._commit_state(record.job, record.step) != record:
            raise CommitConflict(f"{where} is already there, damaged or different from this node's record: kept")
        return True

    def _put_index(self, commit: ObjectStepCommit, record: CommitRecord, metas: dict[int, ShardMeta]) -> None:
        """Upload the step's index before its commit record, where some record is sharded (as on NVMe)."""
        try:
            index = index_bytes(record, metas.__getitem__)  # the records just checked: none is read again
        except CorruptCheckpoint as e:  # loads build it from the records, and say what is wrong with them
            log.error("%s step %d: no index uploaded: %s", record.job, record.step, e)
            return
        if index is not None:
            commit.put_index(index)

    def steps_with_unfinished_uploads(self, job: str) -> list[int]:
        """Return the steps of a job with a multipart upload left unfinished (by a crash, or under way)."""
        steps = set()
        for path in self._guarded(self.store.unfinished_uploads, job):
            name = path.split("/")[1] if path.count("/") >= 2 else ""
            if name.isdigit():
                steps.add(int(name))
        return sorted(steps)

    def abort_uploads(self, job: str, step: int) -> int:
        """Abort the unfinished multipart uploads of a step; return how many."""
        return int(self._guarded(self.store.abort_uploads, job, str(step)))

    def remove_step(self, job: str, step: int) -> None:
        """Remove a step: its commit record goes first, then its objects and unfinished uploads."""
        with self._lock:
            self._records.pop((job, step), None)
        self._forget_listing(job)
        self.store.remove(job, str(step), COMMIT_NAME)
        self.store.remove_dir(job, str(step))
        self.store.abort_uploads(job, str(step))

    def close(self) -> None:
        """Nothing to release: the store's connections belong to fsspec."""
