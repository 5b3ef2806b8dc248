"""Find, check and remove shard objects in a store: listings kept a moment, and work on every rank of a step.

ObjectTier calls these on its callers' threads (the uploader's, retention's object thread, the
CLI's); a call about many ranks sends its requests COMMIT_CHECK_THREADS at a time on the pool
given at construction (Executors.object_requests). listed() keeps a directory's listing
LISTING_TTL_S: a rank's own directory tells holds(), has_shard() and read_into() which objects it
has, of which size. In the hashed layout (object_keys) a step's ranks lie in at most min(256, world) directories:

- matching() lists each of them once a call, and reads a rank's shard record once over every call
  for one commit record: a rank found matching is then only seen again in its directory's listing.
- remove() removes the step's directory, then every rank's objects by name (from the world size of
  the step's record), or what a listing of every hash prefix finds when the step has no readable
  record; then its unfinished uploads.
- steps() and unfinished_steps() find what a crash before the commit left under the hash prefixes
  (256 listings a job): steps() keeps its answer SCAN_INTERVAL_S unless asked afresh.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import TypeVar

from ckpt_core.errors import CheckpointError
from ckpt_core.format import CommitRecord, ShardMeta, data_name, digest, meta_name

from ckptd.pool_map import pool_map
from ckptd.storage.object_store import ObjectStore
from ckptd.tiers.object.keys import (
    FLAT_KEYS,
    HASHED_KEYS,
    Directory,
    all_prefixes,
    dirs_of,
    hash_prefix,
    hashed_dir,
    hashed_job_dir,
    shard_dir,
    shard_names,
    step_dir,
    step_number,
)
from ckptd.tiers.object.layout import frames_name, zstd_name

LISTING_TTL_S = 1.0  # a directory's listing is kept this long: one pass of retention, or one read, lists once
COMMIT_CHECK_THREADS = 32  # requests at once when a step's ranks are checked, removed or looked for
MATCHED_STEPS_KEPT = 8  # steps whose matching ranks are remembered between one commit poll and the next
SCAN_INTERVAL_S = 600.0  # how long a listing of a job's hash prefixes is kept (`ckptd gc` lists them afresh)

T = TypeVar("T")
R = TypeVar("R")


def holds_data(meta: ShardMeta, names: dict[str, int]) -> bool:
    """Say whether a listing holds the shard's record and its data in one format, of the right size."""
    rank = meta.rank
    plain = names.get(data_name(rank)) == meta.data_size_bytes
    compressed = zstd_name(rank) in names and frames_name(rank) in names
    return meta_name(rank) in names and plain != compressed


class StepShards:
    """Check, find and remove the shard objects of all ranks of a step in one store."""

    def __init__(self, store: ObjectStore, threads: Executor) -> None:
        """threads: where a call's requests about many ranks run, COMMIT_CHECK_THREADS at once."""
        self.store = store
        self._threads = threads
        self._hashed = store.spreads_keys  # a store that keeps the flat layout has nothing under the prefixes
        self._matched: OrderedDict[tuple[str, int, CommitRecord], dict[int, ShardMeta]] = OrderedDict()
        self._scans: dict[str, tuple[float, set[int]]] = {}  # job -> (when, steps under the hash prefixes)
        self._listings: dict[Directory, tuple[float, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def listed(self, directory: Directory) -> dict[str, int]:
        """Return {name: size, -1 for a directory} under directory, listed at most every LISTING_TTL_S."""
        now = time.monotonic()
        with self._lock:
            kept = self._listings.get(directory)
        if kept is not None and now - kept[0] < LISTING_TTL_S:
            return kept[1]
        found = self.store.names(*directory)
        with self._lock:
            for old in [d for d, (at, _) in self._listings.items() if now - at >= LISTING_TTL_S]:
                del self._listings[old]
            self._listings[directory] = (time.monotonic(), found)
        return found

    def forget_listings(self, *directories: Directory) -> None:
        """Drop what is kept of listings this node just changed."""
        with self._lock:
            for directory in directories:
                self._listings.pop(directory, None)

    def matching(self, record: CommitRecord, keys: str) -> dict[int, ShardMeta]:
        """Return {rank: shard record} of the ranks whose shard in the store the record lists, data in place.

        Every directory holding ranks of the step is listed; a record is read only for a rank
        that no earlier call with this record found matching (or whose objects have gone since).
        """
        job, step = record.job, record.step
        with self._lock:
            known = self._matched.get((job, step, record), {})
        dirs = dirs_of(job, step, range(record.world_size), keys)
        found: dict[int, ShardMeta] = {}
        unread: list[tuple[int, Directory, dict[str, int]]] = []
        for (directory, ranks), names in zip(dirs.items(), self._each(self._names, list(dirs)), strict=True):
            for rank in ranks:
                meta = known.get(rank)
                if meta is not None and holds_data(meta, names):
                    found[rank] = meta
                elif meta_name(rank) in names:
                    unread.append((rank, directory, names))

        def read(item: tuple[int, Directory, dict[str, int]]) -> ShardMeta | None:
            rank, directory, names = item
            try:
                raw = self.store.read(*directory, meta_name(rank))
                if digest(raw) != record.shard_meta_xxh3_128[rank]:
                    return None
                meta = ShardMeta.from_bytes(raw, self.store.describe(*directory, meta_name(rank)))
            except (FileNotFoundError, CheckpointError):
                return None
            return meta if holds_data(meta, names) else None

        for (rank, _, _), meta in zip(unread, self._each(read, unread), strict=True):
            if meta is not None:
                found[rank] = meta
        with self._lock:
            self._matched[(job, step, record)] = found
            self._matched.move_to_end((job, step, record))
            while len(self._matched) > MATCHED_STEPS_KEPT:
                self._matched.popitem(last=False)
        return dict(found)

    def forget(self, job: str, step: int) -> None:
        """Drop what is remembered of a step: it was committed or removed."""
        with self._lock:
            for key in [k for k in self._matched if k[:2] == (job, step)]:
                del self._matched[key]
            if job in self._scans:
                self._scans[job][1].discard(step)

    def steps(self, job: str, afresh: bool) -> set[int]:
        """Return the job's steps with shard objects under some hash prefix (256 listings, kept a while)."""
        if not self._hashed:
            return set()
        with self._lock:
            kept = self._scans.get(job)
            if kept is not None and not afresh and time.monotonic() - kept[0] < SCAN_INTERVAL_S:
                return set(kept[1])
        dirs = [hashed_job_dir(prefix, job) for prefix in all_prefixes()]
        found = {
            s
            for names in self._each(self._names, dirs)
            for n, size in names.items()
            if size < 0 and (s := step_number(n)) is not None
        }
        with self._lock:
            self._scans[job] = (time.monotonic(), found)
        return set(found)

    def unfinished_steps(self, job: str) -> set[int]:
        """Return the job's steps with a multipart upload left unfinished, flat or under some hash prefix."""
        dirs = [(job,), *(hashed_job_dir(prefix, job) for prefix in all_prefixes() if self._hashed)]
        steps = set()
        for path in [p for paths in self._each(self._uploads, dirs) for p in paths]:
            parts = path.split("/")  # <job>/<step>/<name>, or _shards/<hh>/<job>/<step>/<name>
            if len(parts) in (3, 5) and (step := step_number(parts[-2])) is not None:
                steps.add(step)
        return steps

    def abort_uploads(self, job: str, step: int, world_size: int | None) -> int:
        """Abort a step's unfinished multipart uploads: flat, and under its ranks' prefixes (or every prefix)."""
        if not self._hashed:
            prefixes = []
        elif world_size is None:
            prefixes = all_prefixes()
        else:
            prefixes = sorted({hash_prefix(job, step, rank) for rank in range(world_size)})
        dirs = [step_dir(job, step), *(hashed_dir(prefix, job, step) for prefix in prefixes)]
        return sum(self._each(lambda d: self.store.abort_uploads(*d), dirs))

    def remove(self, job: str, step: int, world_size: int | None, keys: str = HASHED_KEYS) -> None:
        """Remove a step's objects but its commit record (removed first), then its unfinished uploads.

        The step's directory goes whole (its index, or its shards in the flat layout); the shard
        objects under the hash prefixes go by name, for the world_size ranks of the step's record,
        or, without one (a step never committed), whatever a listing of every hash prefix finds.
        """
        self.store.remove_dir(*step_dir(job, step))
        if not self._hashed or keys == FLAT_KEYS:  # a flat step: its shards went with its directory
            self.store.abort_uploads(*step_dir(job, step))
            self.forget(job, step)
            return
        if world_size is not None:
            paths = [(*shard_dir(job, step, r, HASHED_KEYS), n) for r in range(world_size) for n in shard_names(r)]
        else:
            dirs = [hashed_dir(prefix, job, step) for prefix in all_prefixes()]
            paths = [(*d, n) for d, names in zip(dirs, self._each(self._names, dirs), strict=True) for n in names]
        self.store.remove_objects(paths)
        self.abort_uploads(job, step, world_size)
        self.forget(job, step)

    def _each(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """Return [fn(item) for item in items], COMMIT_CHECK_THREADS at a time."""
        return list(pool_map(self._threads, fn, items, COMMIT_CHECK_THREADS))

    def _names(self, directory: Directory) -> dict[str, int]:
        return self.store.names(*directory)

    def _uploads(self, directory: Directory) -> list[str]:
        return self.store.unfinished_uploads(*directory)
