"""The three small interfaces a tier offers, cut by capability, and the whole-tier types made of them.

ShardReader reads one rank's shard of a complete step, a typed byte request at a time.
StepListing lists complete steps and their commit records; StepCatalog adds what a written
tier's catalog does besides (adopt a commit record, remove a step, what is written but not
complete), and ShardCatalog what a tier written shard by shard on this node's disk does too
(seal a step itself once every rank is in, its holdings, its leftovers). ShardSink takes shards
in, each through one ShardWrite. Each tier implements the ones it has: memory and peer read and
list (Tier); the object store (tiers.object) reads, catalogs and takes shards (WrittenTier); NVMe
(tiers.nvme) reads, catalogs shard by shard and takes shards (DurableTier). The replica store
(tiers.replica_store) and a restore target (tiers.restore_target) are their own small things,
made of a directory tier. Roles outside ckptd/tiers hold a tier by these types only; the
composition root (node.py) and the offline tools' builders alone name the classes.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait

from ckpt_core import shard_io
from ckpt_core.byte_range import WHOLE, ByteRange, ByteRequest
from ckpt_core.chunks import check_chunks, chunk_digests
from ckpt_core.commit_keys import CommitKeys
from ckpt_core.errors import CorruptCheckpoint, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, chunk_ranges
from ckpt_core.history import Line
from ckpt_core.shard_io import ShardSource

from ckptd.cluster.placement import Holding
from ckptd.errors import ShardWriteError, StepChanged

WRITE_BLOCK_BYTES = 32 << 20  # what write_shard hashes, then hands to a writer thread, at a time


def shard_on_tier(meta: ShardMeta, tier_name: str) -> str:
    """Name one copy of a shard in messages: "rank R shard of JOB step S on tier T"."""
    return f"rank {meta.rank} shard of {meta.job} step {meta.step} on tier {tier_name}"


def has_committed_shard(tier: Tier, job: str, step: int, rank: int) -> bool:
    """Say whether a rank's shard is on the tier in a step complete there (locate and fetch ask, on a worker thread)."""
    return tier.has_shard(job, step, rank) and tier.is_complete(job, step)


class ShardReader(ABC):
    """Read one rank's shard of a complete step: the read side of a tier.

    A reader (the load path, fetch, restore, verify, export) calls, from any worker thread:

    1. has_shard(), or shard_source() for where the shard lies on this node;
    2. read_meta() once, for the shard's record, checked against the step's commit record;
    3. read_into() as often as it likes, each time for a ByteRange or a ToEnd request
       (from an offset to the end; WHOLE, the whole shard), every chunk checked;
    4. read_index() where it wants the step's sealed index and this tier keeps one.
    """

    name: str

    @abstractmethod
    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        """Say where a rank's shard of a complete step can be read on this node."""

    @abstractmethod
    def has_shard(self, job: str, step: int, rank: int) -> bool:
        """Say whether a rank's shard of a step is fully written here (in a cluster, a node holds some ranks)."""

    def read_meta(self, job: str, step: int, rank: int) -> ShardMeta:
        """Return a rank's shard record of a complete step, checked against the step's commit record."""
        return shard_io.read_meta(self.shard_source(job, step, rank), rank)

    def read_into(self, meta: ShardMeta, buffer: memoryview, wanted: ByteRequest = WHOLE) -> None:
        """Fill buffer with the wanted bytes of the shard, every chunk checked; raise CorruptCheckpoint naming the tier.

        wanted starts on a chunk boundary; buffer holds its bytes from its first byte.
        """
        shard_io.read_shard_into(self.shard_source(meta.job, meta.step, meta.rank), meta, buffer, wanted)

    def read_index(self, record: CommitRecord) -> bytes | None:
        """Return the step's sealed index if this tier keeps one that belongs to record (None: it keeps none)."""
        return None


class StepListing(ABC):
    """List the complete steps of jobs a tier holds and their commit records: the read side of its catalog.

    Any thread may call it. A step is listed only once it is complete: every rank's shard is
    there and checks, and (for written tiers) its commit record was written last.
    """

    name: str

    @abstractmethod
    def jobs(self) -> list[str]:
        """Return the jobs with at least one step on this tier."""

    @abstractmethod
    def complete_steps(self, job: str) -> list[int]:
        """Return the job's complete steps, oldest first."""

    @abstractmethod
    def commit_record(self, job: str, step: int) -> CommitRecord:
        """Return a complete step's commit record; raise NotFound if it is not complete."""

    def complete_records(self, job: str) -> dict[int, CommitRecord]:
        """Return the commit record of each complete step of the job, oldest first (its history is read off them)."""
        records = {}
        for step in self.complete_steps(job):
            try:
                records[step] = self.commit_record(job, step)
            except NotFound:
                continue  # removed since it was listed
        return records

    def complete_lines(self, job: str) -> dict[int, Line]:
        """Return the line of each complete step of the job (ckpt_core.history), oldest step first (retention, rm)."""
        return {step: record.line for step, record in self.complete_records(job).items()}

    def is_complete(self, job: str, step: int) -> bool:
        """Say whether the step is complete here (a tier may answer without listing every step)."""
        return step in self.complete_steps(job)


class Tier(ShardReader, StepListing):
    """A tier whose complete steps are read and listed, never written through it (memory, peer)."""


class ShardWrite(ABC):
    """One copy of one shard on its way into a durable tier: the one way bytes enter a tier.

    The NVMe flush, the replica receiver (both transports) and the uploader all use it, in
    this order, for one copy of one shard:

    1. DurableTier.open_shard(meta, transfer) returns it, on a worker thread: the step is made
       ready and the rank's older copy stops counting (refused, StepAlreadyComplete, where the
       step is complete here with other shards);
    2. write(range, data) for every byte range of the shard, each on chunk boundaries (the
       last may end with the shard): every chunk is checked against meta's checksums, or
       hashed where meta carries none. With `ordered` False (local directories) ranges come in
       any order from any worker thread, several at once; with it True (the object store's
       streams) they come in order from one thread;
    3. seal(), on a worker thread, once every range is in: the shard is durable and counts
       (the commit protocol of storage.commit_protocol) and seal returns its record, with
       checksums; or abandon(), from any thread, at any point before: what was written goes
       and nothing counts. After either, the ShardWrite is spent.
    """

    meta: ShardMeta
    what: str  # this copy in messages: the shard, the tier and where on it
    ordered: bool = False

    @abstractmethod
    def write(self, byte_range: ByteRange, data: memoryview, digests: Sequence[str] | None = None) -> None:
        """Write one range of the shard's bytes (data holds exactly them), every chunk checked or hashed.

        digests: the range's chunk checksums where the caller computed them from these very
        bytes (the flush hashes ahead, on its own thread, so that replicas start before the
        writes end): taken as they are, neither checked nor computed again.
        """

    @abstractmethod
    def seal(self, record: ShardMeta | None = None) -> ShardMeta:
        """Make the shard durable and counted once every range is in; return its record with checksums.

        record: the full record where the caller built it already from the same checksums
        (write_shard hands one to on_hashed): installed as it is. A record's JSON holds the
        layout, megabytes for a large state, so it is built and serialized once, not twice.
        """

    @abstractmethod
    def abandon(self) -> None:
        """Give the copy up: what was written goes, nothing counts (safe to call twice, or after a failed seal)."""


class ShardSink(ABC):
    """Take shards into a tier, each copy through one ShardWrite: the write side of a tier.

    The NVMe flush, the replica receiver, the uploader, fetch and restore call, from worker
    threads, for one copy of one shard: open_shard(), then the ShardWrite's calls (above) until
    it is sealed or abandoned; or write_shard(), which makes those calls for a whole shard in
    memory. holds() says, from any thread, whether an exact shard record is in already.
    """

    name: str
    commit_keys: CommitKeys  # set by the subclass: signs the shard records write_shard makes, checks those it counts

    @abstractmethod
    def open_shard(self, meta: ShardMeta, transfer: str = "") -> ShardWrite:
        """Begin receiving one copy of a shard (see ShardWrite); transfer names it, for the temporary files."""

    @abstractmethod
    def holds(self, meta: ShardMeta) -> bool:
        """Say whether this exact shard (the same record) is written here."""

    @property
    def write_threads(self) -> Executor | None:
        """Return the threads write_shard hands its blocks to, or None: it writes them itself, in order."""
        return None

    def write_shard(
        self, meta: ShardMeta, data: memoryview, on_hashed: Callable[[ShardMeta], None] | None = None
    ) -> ShardMeta:
        """Write a whole shard from memory through open_shard, write and seal; return its record with checksums.

        Called from a worker thread: the NVMe flush's (data a whole mmap'd slot), fetch_shard's,
        restore's. data holds at least the shard's bytes, page-aligned for direct writes. The
        calling thread goes through it in blocks of WRITE_BLOCK_BYTES, ahead of the writes:
        each block's chunks are checked against meta's checksums or, where meta carries none,
        hashed (once: write() takes those digests), then the block goes to write_threads
        (several at once), or is written there and then for a tier without them or whose
        ShardWrite is ordered. Where meta carries no checksums, on_hashed gets the full
        record, signed with commit_keys, as soon as every chunk is hashed, before the writes
        are durable (replication starts from it). Any failure abandons the copy; an OSError, or bytes that do not
        match meta, is a ShardWriteError naming the shard and the tier. Once written, every block
        is checked once more against the record: a block that changed in memory between its hashing and its
        write (the write reads it again) fails the copy rather than leaving one that fails its own checksums.
        """
        what = shard_on_tier(meta, self.name)
        size, chunk = meta.data_size_bytes, meta.chunk_size_bytes
        if len(data) < size:
            raise ValueError(f"{what}: buffer of {len(data)} bytes is short of the shard's {size}")
        shard = self.open_shard(meta)
        threads = None if shard.ordered else self.write_threads
        writes: list[Future[None]] = []
        try:
            digests: list[str] = []
            block_bytes = max(1, WRITE_BLOCK_BYTES // chunk) * chunk
            for offset, length in chunk_ranges(size, block_bytes):
                block = data[offset : offset + length]
                if meta.chunk_xxh3_128:
                    check_chunks(meta, block, offset, what)
                    block_digests = list(meta.chunk_xxh3_128[offset // chunk : -(-(offset + length) // chunk)])
                else:
                    block_digests = chunk_digests(block, chunk)
                    digests += block_digests
                if threads is None:
                    shard.write(ByteRange(offset, length), block, block_digests)
                else:
                    writes.append(threads.submit(shard.write, ByteRange(offset, length), block, block_digests))
            # A record made here is this node's (the flush of a snapshot it took over): signed here, once.
            record = (
                self.commit_keys.sign(dataclasses.replace(meta, chunk_xxh3_128=tuple(digests)))
                if not meta.chunk_xxh3_128
                else meta
            )
            if not meta.chunk_xxh3_128 and on_hashed is not None:
                on_hashed(record)
            for w in writes:
                w.result()
            # The bytes written must be the ones hashed or checked: a block changed in memory in between (a RAM
            # fault in a staging slot, read again by the write) fails the copy, never sealed with checksums it fails.
            for offset, length in chunk_ranges(size, block_bytes):
                check_chunks(record, data[offset : offset + length], offset, what)
            return shard.seal(record)
        except BaseException as e:
            wait(writes)  # never abandon the copy, nor give data back to the caller, under a write still running
            shard.abandon()
            if isinstance(e, OSError):
                raise ShardWriteError(f"{what}: {e.strerror or e}") from e
            if isinstance(e, CorruptCheckpoint):  # the bytes to write are not the ones meta describes
                raise ShardWriteError(str(e)) from e
            raise


@dataclasses.dataclass(frozen=True)
class Listed:
    """What retention's listing showed of a step it chose to remove: the line it was complete on, or None.

    The tier checks it when the removal comes (remove_step), under the step's lock where it has
    one: between the listing and the removal a rollback's new line may save the same step
    number again, and what it writes must not go with the old step.
    """

    line: Line | None  # None: the step was incomplete

    def check(self, tier: str, job: str, step: int, record: CommitRecord | None, writing: bool) -> None:
        """Raise StepChanged unless the step is as listed: record is its commit record now (None: incomplete),
        writing whether a copy into it is under way."""
        if (record.line if record is not None else None) != self.line:
            was = "incomplete" if self.line is None else "complete"
            raise StepChanged(f"{job} step {step} on tier {tier} changed since it was listed ({was} then): it stays")
        if writing:
            raise StepChanged(f"{job} step {step} on tier {tier} is being written since it was listed: it stays")


class StepCatalog(StepListing):
    """The catalog of a written tier: which steps are complete there, changed by the save path alone.

    The save path is its one writer (the load path's fetched copies aside), from worker threads,
    never two calls for the same step at once: adopt_commit() seals a step with a commit record
    made elsewhere (for the object store, the record NVMe sealed), remove_step() takes one out
    (for retention, `ckptd rm`, `gc --all`). Anyone may list, besides complete steps, every step
    with anything written (all_steps) and the damaged commit records. What an interrupted write
    left that no step's removal takes (the object store's unfinished multipart uploads) `ckptd gc`
    finds with unfinished_steps() and clears with abort_unfinished(); a tier that clears its own at
    start-up (ShardCatalog.remove_leftovers) has none.
    """

    @abstractmethod
    def all_steps(self, job: str, afresh: bool = False) -> list[int]:
        """Return every step of the job with anything written, complete or not, oldest first.

        afresh: look again now where the tier keeps what it found for a while (the object
        store's scan of its hash prefixes; `ckptd gc`); a directory is listed afresh every time.
        """

    @abstractmethod
    def damaged_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is there but does not check (never removed, only reported)."""

    @abstractmethod
    def adopt_commit(self, record: CommitRecord) -> bool:
        """Seal a step with a commit record made elsewhere (the step is complete across the cluster).

        Return whether the step is now complete here with that record (False: not every rank's
        shard is here to match it).
        """

    @abstractmethod
    def remove_step(self, job: str, step: int, listed: Listed | None = None) -> None:
        """Remove a step: it stops being listed first, then its shards go.

        listed: what retention's listing showed of the step when it chose to remove it; the step
        goes only if it is still so (else StepChanged). None (`ckptd rm`, `gc --all`): whatever it holds.
        """

    def unfinished_steps(self, job: str) -> list[int]:
        """Return the steps of the job with writes an interrupted run left unfinished that only gc clears."""
        return []

    def abort_unfinished(self, job: str, step: int) -> int:
        """Clear a step's unfinished writes (unfinished_steps); return how many."""
        return 0


class ShardCatalog(StepCatalog):
    """The catalog of a tier on this node written shard by shard, with the atomic commit protocol of docs/FORMAT.md.

    Besides StepCatalog's, from the save path, in this order:

    1. remove_leftovers() once, at start-up, before anything else;
    2. after each shard is sealed (ShardSink): try_commit(), which seals the step once every
       rank is in, or adopt_commit(), when the step is complete across nodes (shards the
       record does not list are removed first);
    3. from retention: retry_removals() before each pass, for removals that failed.

    Anyone may list the shards a step holds (holdings), its checked commit record, and when it was sealed.
    """

    @abstractmethod
    def checked_commit(self, job: str, step: int) -> CommitRecord | None:
        """Return the step's commit record if it is there and checks, else None (not complete here)."""

    @abstractmethod
    def committed_unix_s(self, job: str, step: int) -> float:
        """Return when a complete step's commit record was written here (raise OSError if it is gone)."""

    @abstractmethod
    def holdings(self, job: str, step: int, node: str = "") -> list[Holding]:
        """Return the readable, counted shard records of a step here, as held by node (a damaged one left out)."""

    @abstractmethod
    def try_commit(self, job: str, step: int, world_size: int, run_id: str = "") -> CommitRecord | None:
        """Write the step's commit record if every rank's shard is in; return it, or None.

        With a run_id, shards of the step written by another run of the job are
        stale: they are removed, never sealed into the step.
        """

    removal_failures: int  # removals that failed (logged, retried by retry_removals)

    @abstractmethod
    def retry_removals(self) -> list[str]:
        """Finish removals that failed earlier (their steps are unlisted already); return what was removed."""

    @abstractmethod
    def remove_leftovers(self) -> list[str]:
        """Remove what interrupted writes and removals left; return what was removed."""


class WrittenTier(Tier, ShardSink, StepCatalog):
    """A tier that reads, lists, takes shards and keeps a catalog: the object store (tiers.object)."""


class DurableTier(WrittenTier, ShardCatalog):
    """A written tier on this node's disk, whose catalog it seals shard by shard: NVMe and the replica store."""
