"""The object tier: complete steps in an object store, their shards spread over hash prefixes.

`<url>/<job>/<step>/` holds the step's `INDEX.json` and, written last, its `COMMIT.json`. Each
rank's `rank-NNNNN.data` (or, compressed, `rank-NNNNN.data.zst` with its frame index
`rank-NNNNN.frames.json`), then its `rank-NNNNN.meta.json`, lie under `<url>/_shards/<hh>/<job>/<step>/`
(object_keys names them; a step committed before that layout has them beside its commit record, and
its record says so). A step is listed only through its commit record, written create-only once every
rank's shard is there and matches it. A shard comes in through open_shard (the uploader's only way
in), whose ShardWrite is shard_write's; how its bytes become objects is layout's; what is done to
every rank of a step at once (the commit check, removal, the scan for leftovers) is shards'. Calls
block: the daemon makes them from its threads, the CLI from its own. What one call asks at once (a
job's commit records, a shard's ranged GETs, a step's ranks) runs on the pools given at construction.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager

from ckpt_core.byte_range import WHOLE, ByteRequest
from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import COMMIT_NAME, INDEX_NAME, JOB_RE, CommitRecord, ShardMeta, data_name, digest, meta_name
from ckpt_core.history import generation
from ckpt_core.shard_io import ShardSource
from ckpt_core.step_index import StepIndex, index_bytes

from ckptd.errors import AlreadyHeld, CommitConflict
from ckptd.keyed import ThreadKeyedLocks
from ckptd.pool_map import pool_map
from ckptd.storage.commit_protocol import ObjectStepCommit
from ckptd.storage.object_store import ObjectStore
from ckptd.tiers.base import Listed, WrittenTier
from ckptd.tiers.object.keys import FLAT_KEYS, HASHED_KEYS, KNOWN_KEYS, Directory, shard_dir, step_dir, step_number
from ckptd.tiers.object.layout import (
    READ_THREADS,
    Piece,
    checked_frame_sizes,
    frame_groups,
    frames_name,
    plain_pieces,
    range_bytes,
    unpack_range,
    zstd_name,
)
from ckptd.tiers.object.shard_write import ObjectShardWrite
from ckptd.tiers.object.shards import StepShards, holds_data

log = logging.getLogger(__name__)

UNCOMMITTED_STEPS_KEPT = 64  # steps an upload found not complete in the store, remembered for the next ranks


class ObjectTier(WrittenTier):
    """List, read, upload, commit and remove steps in an object store; str() of it is the store's URL, for messages."""

    name = "object"

    def __init__(
        self,
        store: ObjectStore,
        read_threads: Executor,
        request_threads: Executor,
        compression: str = "none",
        commit_keys: CommitKeys = UNSIGNED,
    ) -> None:
        """read_threads: a shard's ranged GETs, READ_THREADS by each read (Executors.object_reads);
        request_threads: a job's commit records read, READ_THREADS by each listing, and a step's ranks
        checked or removed, COMMIT_CHECK_THREADS by each call (Executors.object_requests).

        compression: how shards written here are stored, "none" or "zstd" ([object] compression).
        commit_keys (Config.commit_keys): a commit record in the store not signed by one of them is damaged.
        """
        self.store = store
        self.commit_keys = commit_keys
        self.compression = compression
        self.shards = StepShards(store, request_threads)
        self._read_threads = read_threads
        self._request_threads = request_threads
        self.keys = HASHED_KEYS if store.spreads_keys else FLAT_KEYS  # where this tier puts shard objects
        # (job, step) -> (commit record, its object_keys), or "damaged" (logged once): a record once read is
        # kept while its step is listed (a commit record is written create-only: it never changes in place).
        self._records: dict[tuple[str, int], tuple[CommitRecord, str] | str] = {}
        self._uncommitted: OrderedDict[tuple[str, int], None] = OrderedDict()  # steps found not complete here
        self._lock = threading.Lock()
        self._listing: ThreadKeyedLocks[str] = ThreadKeyedLocks()  # by job: held while its commit records are read

    def __str__(self) -> str:
        """Return the store's URL (without credentials), for messages and status (a step: f"{tier}/{job}/{step}")."""
        return self.store.describe()

    # -- listing ------------------------------------------------------------------

    def jobs(self) -> list[str]:
        with self._asking():
            found = [n for n, size in self.store.names().items() if size < 0 and JOB_RE.fullmatch(n)]
        return sorted(j for j in found if self.complete_steps(j))

    @contextmanager
    def _asking(self, *names: str) -> Iterator[None]:
        """Raise what the store raises as a CheckpointError naming the place asked about."""
        try:
            yield
        except OSError as e:
            raise CheckpointError(f"object store {self.store.describe(*names)}: {e}") from e

    def _listed(self, directory: Directory) -> dict[str, int]:
        with self._asking(*directory):
            return self.shards.listed(directory)

    def _steps(self, job: str) -> list[int]:
        """Return the job's step numbers with a directory under <job>/ (a commit record, an index, flat shards)."""
        names = self._listed((job,))
        steps = sorted(s for n, size in names.items() if size < 0 and (s := step_number(n)) is not None)
        with self._lock:
            for key in [k for k in self._records if k[0] == job and k[1] not in steps]:
                del self._records[key]  # removed (by another node's retention, a lifecycle rule)
        return steps

    def all_steps(self, job: str, afresh: bool = False) -> list[int]:
        """Return every step of the job with anything uploaded, complete or not, oldest first.

        A step with shard objects only (a crash before its commit) is found by listing every hash
        prefix: at most every SCAN_INTERVAL_S, and now when afresh (`ckptd gc`).
        """
        with self._asking(job):
            return sorted(set(self._steps(job)) | self.shards.steps(job, afresh=afresh))

    def complete_steps(self, job: str) -> list[int]:
        states = self._commit_states(job)
        return [s for s, state in states.items() if isinstance(state, CommitRecord)]

    def complete_records(self, job: str) -> dict[int, CommitRecord]:
        """Return each complete step's commit record from one listing (records once read are kept)."""
        return {s: state for s, state in self._commit_states(job).items() if isinstance(state, CommitRecord)}

    def damaged_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is there but does not check."""
        return [s for s, state in self._commit_states(job).items() if state == "damaged"]

    def _commit_states(self, job: str) -> dict[int, CommitRecord | str]:
        """Return {step: its commit record, or "damaged"} for each step with a COMMIT.json, oldest first.

        One listing of the step names; then each record is read once (in parallel) and kept while listed.
        One listing of a job at a time: another waits for it, then reads only what it left unread (after
        a restart, with a long history in the store, several callers would otherwise read every record).
        """
        with self._listing.hold(job):
            return self._read_commit_states(job)

    def _read_commit_states(self, job: str) -> dict[int, CommitRecord | str]:
        steps = self._steps(job)
        with self._lock:  # other threads drop entries meanwhile (a listing, a removal)
            known = {s: self._records.get((job, s)) for s in steps}
        unread = [s for s, entry in known.items() if entry is None]
        states: dict[int, CommitRecord | str] = {
            s: entry if isinstance(entry, str) else entry[0] for s, entry in known.items() if entry is not None
        }
        # A commit record, once read, is kept; the others are asked for each time, in parallel.
        read = pool_map(self._request_threads, lambda s: self._commit_state(job, s), unread, READ_THREADS)
        states.update(zip(unread, read, strict=True))
        return {s: state for s, state in sorted(states.items()) if state != "missing"}

    def _commit_state(self, job: str, step: int) -> CommitRecord | str:
        """Return the step's commit record, or "missing" or "damaged"."""
        state = self._committed(job, step)
        return state if isinstance(state, str) else state[0]

    def _shard_keys(self, job: str, step: int) -> str:
        """Return how the store keys a step's shard objects: as its commit record says, hashed while it has none."""
        state = self._committed(job, step)
        return self.keys if isinstance(state, str) else state[1]

    def _committed(self, job: str, step: int) -> tuple[CommitRecord, str] | str:
        """Return (the step's commit record, its object_keys), or "missing" or "damaged"."""
        with self._lock:
            cached = self._records.get((job, step))
        if cached is not None:
            return cached
        where = self.store.describe(*step_dir(job, step), COMMIT_NAME)
        try:
            raw = self.store.read(*step_dir(job, step), COMMIT_NAME)
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            raise CheckpointError(f"object store {where}: {e}") from e
        try:
            record, keys = CommitRecord.from_object_bytes(raw, where, self.commit_keys)
            if (record.job, record.step) != (job, step):
                raise CorruptCheckpoint(f"{where} describes {record.job} step {record.step}")
            if keys not in KNOWN_KEYS:
                raise CorruptCheckpoint(f"{where}: its shards lie under object keys {keys!r}, unknown to this ckptd")
        except CheckpointError as e:
            log.error("%s", e)
            with self._lock:
                self._records[(job, step)] = "damaged"  # kept as the good ones are: neither read nor logged again
            return "damaged"
        with self._lock:
            self._records[(job, step)] = (record, keys)
        return record, keys

    def is_complete(self, job: str, step: int) -> bool:
        """Say whether a step is complete in the store, from its commit record read afresh: no listing."""
        with self._lock:  # not what is kept: another node's retention may have removed the step
            if self._records.get((job, step)) != "damaged":  # (a damaged record stays as it is, until removed)
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
        return meta_name(rank) in self._listed(shard_dir(job, step, rank, self._shard_keys(job, step)))

    # -- reading --------------------------------------------------------------------

    def _what(self, meta: ShardMeta, directory: Directory) -> str:
        where = self.store.describe(*directory)
        return f"rank {meta.rank} shard of {meta.job} step {meta.step} on tier object ({where})"

    def read_meta(self, job: str, step: int, rank: int, record: CommitRecord | None = None) -> ShardMeta:
        """Return a rank's shard record, checked against the step's commit record (given, or the store's)."""
        record = record or self.commit_record(job, step)
        if rank >= record.world_size:
            raise NotFound(f"{job} step {step} has no rank {rank} (world_size {record.world_size})")
        directory = shard_dir(job, step, rank, self._shard_keys(job, step))
        where = self.store.describe(*directory, meta_name(rank))
        try:
            raw = self.store.read(*directory, meta_name(rank))
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
        where = self.store.describe(*step_dir(record.job, record.step), INDEX_NAME)
        try:
            data = self.store.read(*step_dir(record.job, record.step), INDEX_NAME)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(f"{where}: {e}") from e
        StepIndex.from_bytes(data, where).check(record, where)
        return data

    def read_into(self, meta: ShardMeta, buffer: memoryview, wanted: ByteRequest = WHOLE) -> None:
        """Fill buffer with the wanted bytes of the shard, fetched in parallel ranged GETs, every chunk checked.

        wanted as in ShardReader.read_into: only the stored bytes (or compressed frames) that
        hold it are fetched. One listing of the rank's directory says which format and size.
        """
        directory = shard_dir(meta.job, meta.step, meta.rank, self._shard_keys(meta.job, meta.step))
        what = self._what(meta, directory)
        byte_range = wanted.resolve(meta.data_size_bytes)
        names = self._listed(directory)
        if zstd_name(meta.rank) in names:
            frame_sizes = self._frame_sizes(meta, directory, what)
            pieces = list(frame_groups(meta, frame_sizes, range_bytes(sum(frame_sizes)), byte_range))
            name = zstd_name(meta.rank)
        elif data_name(meta.rank) in names:
            if names[data_name(meta.rank)] != meta.data_size_bytes:
                size = names[data_name(meta.rank)]
                raise CorruptCheckpoint(f"{what}: {size} bytes stored, expected {meta.data_size_bytes}")
            pieces = plain_pieces(meta, byte_range)
            name = data_name(meta.rank)
        else:
            raise CorruptCheckpoint(f"{what}: data object missing")

        def fetch(piece: Piece) -> str | None:
            start, stored, frames = piece
            try:
                blob = self.store.read(*directory, name, start=start, end=start + stored)
            except OSError as e:  # the way to the store failed: not a bad byte
                raise CheckpointError(f"{what}: reading bytes {start}-{start + stored - 1} of {name}: {e}") from e
            return unpack_range(meta, blob, frames, buffer, compressed=name.endswith(".zst"), base=byte_range.offset)

        for bad in pool_map(self._read_threads, fetch, pieces, READ_THREADS):
            if bad is not None:
                raise CorruptCheckpoint(f"{what}: {bad}")

    def _frame_sizes(self, meta: ShardMeta, directory: Directory, what: str) -> list[int]:
        try:
            raw = self.store.read(*directory, frames_name(meta.rank))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{what}: the frame index of its compressed data is missing") from None
        except OSError as e:
            raise CheckpointError(f"{what}: {e}") from e
        return checked_frame_sizes(raw, meta, what)

    # -- writing ----------------------------------------------------------------------

    def holds(self, meta: ShardMeta) -> bool:
        """Say whether exactly this shard (record and data) is already uploaded where an upload puts it.

        A listing of the rank's own directory (a few ranks share it), then a read of its record.
        """
        directory = shard_dir(meta.job, meta.step, meta.rank, self.keys)
        if not holds_data(meta, self._listed(directory)):
            return False
        try:
            return self.store.read(*directory, meta_name(meta.rank)) == meta.to_bytes()
        except FileNotFoundError:
            return False

    def open_shard(self, meta: ShardMeta, transfer: str = "") -> ObjectShardWrite:
        """Begin uploading one shard, under the rank's hash prefix (see ObjectShardWrite); transfer names the copy sent.

        Called on an uploader thread. A step complete in the store is never written to: where
        its commit record lists this very shard there is nothing to write (AlreadyHeld), else
        CommitConflict. Then the rank's older record goes (that copy stops counting), and the
        objects of the data format not written this time.
        """
        job, rank = meta.job, meta.rank
        directory = shard_dir(job, meta.step, rank, self.keys)
        # The commit record is asked for once per step here, and whenever the rank's directory holds a
        # record of it: a commit comes after every rank's record, so with none of this rank, none came since.
        if meta_name(rank) in self._listed(directory) or (job, meta.step) not in self._uncommitted:
            state = self._commit_state(job, meta.step)  # from the store, unless a commit record was read already
            if isinstance(state, CommitRecord) and generation(state.line) < generation(meta.line):
                self._unlist_superseded(state, meta)
                state = "missing"
            listed = isinstance(state, CommitRecord) and rank < state.world_size
            if listed and state.shard_meta_xxh3_128[rank] == digest(meta.to_bytes()):  # type: ignore[union-attr]
                raise AlreadyHeld(f"{self._what(meta, directory)}: listed by the step's commit record already")
            if state != "missing":
                raise CommitConflict(
                    f"{self.store.describe(job, str(meta.step))} has a commit record for other shards (or a damaged "
                    "one); a complete step is never rewritten"
                )
            with self._lock:
                self._uncommitted[(job, meta.step)] = None
                while len(self._uncommitted) > UNCOMMITTED_STEPS_KEPT:
                    self._uncommitted.popitem(last=False)
        compressed = self.compression == "zstd"
        commit = ObjectStepCommit(self.store, job, meta.step)
        try:
            if compressed:
                commit.begin_shard(rank, directory, [data_name(rank)])
                data = commit.open_data(directory, zstd_name(rank))
            else:
                commit.begin_shard(rank, directory, [frames_name(rank), zstd_name(rank)])
                data = commit.open_data(directory, data_name(rank))
        except BaseException:
            self.shards.forget_listings(directory)
            raise
        return ObjectShardWrite(
            meta,
            commit,
            directory,
            data,
            compressed,
            what=self._what(meta, directory),
            source=f"the local copy {transfer}" if transfer else "the copy sent",
            on_spent=lambda: self.shards.forget_listings(directory),
        )

    def _unlist_superseded(self, old: CommitRecord, meta: ShardMeta) -> None:
        """Remove the commit record of a step a rollback's line saves again (ckpt_core.history): the step it made
        complete is superseded. Its shard objects are written over rank by rank, and the new record lists the
        new ones; removing a record that is gone already (another rank, another node) is no error."""
        job, step = meta.job, meta.step
        log.warning(
            "%s step %d in the object store (%s, saved %s) is superseded by a rollback's line that saves it again: "
            "its commit record goes",
            *(job, step, self.store.describe(job, str(step)), old.committed_at or "at an unknown time"),
        )
        with self._lock:
            self._records.pop((job, step), None)
        self.shards.forget_listings((job,))
        self.store.remove(*step_dir(job, step), COMMIT_NAME)

    def adopt_commit(self, record: CommitRecord) -> bool:
        """Write the step's commit record (NVMe's), create-only, if every rank's shard is there and matches it.

        Return whether the step is now complete in the store with this record, False while ranks are
        missing. Each poll lists the directories of the step's ranks once and reads only the records
        not yet found matching. A record already there stays, even if it differs: CommitConflict
        (none replaces another's)."""
        job, step = record.job, str(record.step)
        with self._asking(job, step):
            metas = self.shards.matching(record, self.keys)
        if len(metas) < record.world_size:
            return False
        where = self.store.describe(job, step, COMMIT_NAME)
        try:
            commit = ObjectStepCommit(self.store, job, record.step)
            self._put_index(commit, record, metas)
            created = commit.write_commit(record.to_bytes(object_keys=self.keys))
        except OSError as e:
            raise CheckpointError(f"object store {where}: {e}") from e
        finally:
            self.shards.forget_listings((job,))
        self.shards.forget(job, record.step)
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

    # -- removing ---------------------------------------------------------------------

    def unfinished_steps(self, job: str) -> list[int]:
        """Return the steps of a job with a multipart upload left unfinished (by a crash, or under way)."""
        with self._asking(job):
            return sorted(self.shards.unfinished_steps(job))

    def abort_unfinished(self, job: str, step: int) -> int:
        """Abort the unfinished multipart uploads of a step, under every hash prefix; return how many."""
        with self._asking(job, str(step)):
            return self.shards.abort_uploads(job, step, world_size=None)

    def remove_step(self, job: str, step: int, listed: Listed | None = None) -> None:
        """Remove a step: its commit record goes first, then its other objects (StepShards.remove).

        With listed (retention's plan), its commit record is read afresh and a step no longer as
        listed stays (StepChanged). The store has no lock to hold: this narrows the window, the
        Uploader's busy steps (which retention spares) close the rest.
        """
        if listed is not None:
            with self._lock:
                self._records.pop((job, step), None)  # read afresh below, not as cached at the listing
        state = self._committed(job, step)  # which ranks it has, and where: read before the record goes
        if listed is not None:
            listed.check(self.name, job, step, state[0] if isinstance(state, tuple) else None, writing=False)
        with self._lock:
            self._records.pop((job, step), None)
        self.shards.forget_listings((job,))
        self.store.remove(*step_dir(job, step), COMMIT_NAME)
        if isinstance(state, str):  # no readable record: look for its shards everywhere
            self.shards.remove(job, step, None)
        else:
            self.shards.remove(job, step, state[0].world_size, state[1])

    def close(self) -> None:
        """Nothing to release: the store's connections belong to fsspec."""
