"""The interfaces every tier offers to the save path, replication, retention and the CLI.

Tier: read complete steps. DurableTier: also receive shards, each through one ShardWrite,
and seal steps. The memory tier only reads; NVMe and the replica store (tiers.nvme) and the
object store (tiers.object) are durable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from ckpt import shard_io
from ckpt.format import CommitRecord, ShardMeta
from ckpt.shard_io import ShardSource

from ckptd.byte_range import ByteRange


class Tier(ABC):
    """Hold complete steps of jobs, each readable shard by shard.

    Listing and reading may come from any thread. A step is listed only once it is
    complete: every rank's shard is there and checks, and (for durable tiers) its
    commit record was written last.
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

    @abstractmethod
    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        """Say where a rank's shard of a complete step can be read on this node."""

    @abstractmethod
    def has_shard(self, job: str, step: int, rank: int) -> bool:
        """Say whether a rank's shard of a step is fully written here (in a cluster, a node holds some ranks)."""

    def read_meta(self, job: str, step: int, rank: int) -> ShardMeta:
        """Return a rank's shard record of a complete step, checked against the step's commit record."""
        return shard_io.read_meta(self.shard_source(job, step, rank), rank)

    def read_into(self, meta: ShardMeta, buffer: memoryview, offset: int = 0, length: int = -1) -> None:
        """Fill buffer with the shard's bytes, every chunk checked; raise CorruptCheckpoint naming the tier.

        A range: from offset (a multiple of the chunk size), length bytes (-1: to the
        end); buffer holds it from its first byte.
        """
        source = self.shard_source(meta.job, meta.step, meta.rank)
        shard_io.read_shard_into(source, meta, buffer, offset, length)


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
    ordered: bool = False

    @abstractmethod
    def write(self, byte_range: ByteRange, data: memoryview, digests: Sequence[str] | None = None) -> None:
        """Write one range of the shard's bytes (data holds exactly them), every chunk checked or hashed.

        digests: the range's chunk checksums where the caller computed them from these very
        bytes (the flush hashes ahead, on its own thread, so that replicas start before the
        writes end): taken as they are, neither checked nor computed again.
        """

    @abstractmethod
    def seal(self) -> ShardMeta:
        """Make the shard durable and counted once every range is in; return its record with checksums."""

    @abstractmethod
    def abandon(self) -> None:
        """Give the copy up: what was written goes, nothing counts (safe to call twice, or after a failed seal)."""


class DurableTier(Tier):
    """A tier written shard by shard with the atomic commit protocol of docs/FORMAT.md.

    The pipeline drives it in this order, from worker threads, never two calls for
    the same step at once:

    1. remove_leftovers() once, at start-up, before anything else;
    2. for each shard: open_shard(), then the ShardWrite's calls (above) until it is sealed;
    3. after each shard: try_commit(), which seals the step once every rank is in, or
       adopt_commit(), when the step is complete across nodes;
    4. from retention: remove_step(), for steps the config no longer keeps, and
       retry_removals() before each pass, for removals that failed earlier;
    5. close() at shutdown.
    """

    @abstractmethod
    def open_shard(self, meta: ShardMeta, transfer: str = "") -> ShardWrite:
        """Begin receiving one copy of a shard (see ShardWrite); transfer names it, for the temporary files."""

    def is_complete(self, job: str, step: int) -> bool:
        """Say whether the step is complete here (a tier may answer without listing every step)."""
        return step in self.complete_steps(job)

    @abstractmethod
    def committed_unix_s(self, job: str, step: int) -> float:
        """Return when a complete step's commit record was written here (raise OSError if it is gone)."""

    @abstractmethod
    def holds(self, meta: ShardMeta) -> bool:
        """Say whether this exact shard (the same record) is written here."""

    @abstractmethod
    def all_steps(self, job: str) -> list[int]:
        """Return every step of the job with anything written, complete or not, oldest first."""

    @abstractmethod
    def damaged_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is there but does not check (never removed, only reported)."""

    @abstractmethod
    def try_commit(self, job: str, step: int, world_size: int, run_id: str = "") -> CommitRecord | None:
        """Write the step's commit record if every rank's shard is in; return it, or None.

        With a run_id, shards of the step written by another run of the job are
        stale: they are removed, never sealed into the step.
        """

    @abstractmethod
    def adopt_commit(self, record: CommitRecord) -> bool:
        """Seal a step with a commit record made elsewhere (the step is complete across the cluster).

        Shards the record does not list are removed first; return whether the step is
        now complete here with that record.
        """

    @abstractmethod
    def remove_step(self, job: str, step: int) -> None:
        """Remove a step: it stops being listed first, then its shards go."""

    removal_failures: int  # removals that failed (logged, retried by retry_removals)

    @abstractmethod
    def retry_removals(self) -> list[str]:
        """Finish removals that failed earlier (their steps are unlisted already); return what was removed."""

    @abstractmethod
    def remove_leftovers(self) -> list[str]:
        """Remove what interrupted writes and removals left; return what was removed."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and handles."""
