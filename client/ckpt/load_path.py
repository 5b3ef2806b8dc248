"""The load path of one rank: locate a step through the daemon, read its bytes from the fastest good copy.

LoadPath.load() reads this rank's whole shard (ckpt.local_read); load_into() fills a state in place
from any ranks' byte ranges (ckpt.range_read, then ckpt.reshard); open_step() gives ckpt.dcp's Reader
the same ranged reader. The daemon only says where the copies are (ckpt.transport); the bytes are
read and checked here, from the files, or through the daemon for ranks this node does not hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, InvalidArgument, NotFound
from ckpt_core.format import CommitRecord, counted
from ckpt_core.step_index import StepIndex

from ckpt.key_filter import KeyFilter, LoadReport
from ckpt.local_read import checked_index, load_first_good
from ckpt.placement import Placement
from ckpt.range_read import StepReader
from ckpt.reshard import load_into, report_left
from ckpt.transport import DaemonClient, LocatedStep, ShardId

log = logging.getLogger("ckpt")


class LoadPath:
    """Load one rank's state of a job's step through the local daemon, on the loading thread.

    One per Checkpointer. Each load first locates its step, then tells located(step, next_line)
    (the save path's continue_after: the next save continues after the step loaded), then reads.
    """

    def __init__(self, daemon: DaemonClient, shard: ShardId, located: Callable[[int, str], None]) -> None:
        self._daemon = daemon
        self._shard = shard  # step 0: this rank's place in the job; each load names its step
        self._located = located

    def load(self, step: int | None, place: Placement, tier: str, weights_only: bool) -> Any:
        """Return this rank's state at step (None: the latest), read from the first verified copy."""
        job, rank, world_size = self._shard.job, self._shard.rank, self._shard.world_size
        found = self._daemon.locate(job, step, rank, tier)
        if found.world_size != world_size:
            raise InvalidArgument(
                f"{job} step {found.step} was saved by {counted(found.world_size, 'rank')}, and this Checkpointer has "
                f"world_size {world_size}: rank {rank}'s shard of it belongs to another sharding. "
                f"To reshard it onto {world_size} ranks, load it with load(step={found.step}, into=state), "
                "where state holds this rank's tensors (DTensors for the sharded ones) to fill in place"
            )
        self._located(found.step, found.next_line)
        try:
            try:
                return load_first_good(found.sources, rank, place, weights_only=weights_only)
            except NotFound as e:  # the copy it was pointed at went meanwhile (an operator, a race): ask again, once
                log.warning("ckpt: %s; asking the daemon where the shard is now", e)
                again = self._daemon.locate(job, found.step, rank, tier)
                return load_first_good(again.sources, rank, place, weights_only=weights_only)
        except CorruptCheckpoint as e:
            if tier not in ("auto", "peer", "object"):
                raise
            # Every copy on this node is bad: the daemon fetches a good one from the peers
            # or the object store, over them, and the load reads that.
            log.warning("ckpt: %s; asking the daemon for a good copy from another node or the object store", e)
            try:
                again = self._daemon.locate(job, found.step, rank, tier, refetch=True)
            except CheckpointError as other:
                raise CorruptCheckpoint(f"{e}; and no good copy elsewhere: {other}") from other
            return load_first_good(again.sources, rank, place, weights_only=weights_only)

    def load_into(
        self, into: Any, step: int | None, tier: str, strict: bool, keys: KeyFilter, weights_only: bool
    ) -> tuple[Any, LoadReport]:
        """Fill into from a step and return it with what was left: ranks this node holds from files, others remotely."""
        reader, index, found = self._open(step, tier)
        self._located(found.step, found.next_line)
        loaded, report = load_into(into, reader, index, self._shard.rank, strict, keys, weights_only)
        report_left(report, self._shard.job)
        return loaded, report

    def open_step(self, step: int | None, tier: str) -> tuple[StepReader, StepIndex | None]:
        """Return a reader of every rank's bytes of a complete step (None: the latest), and the step's index."""
        reader, index, _ = self._open(step, tier)
        return reader, index

    def _open(self, step: int | None, tier: str) -> tuple[StepReader, StepIndex | None, LocatedStep]:
        job = self._shard.job
        found = self._daemon.locate_step(job, step, tier)
        record = CommitRecord.from_bytes(found.commit_json, f"commit record of {job} step {found.step}")
        if record.step != found.step:  # the sources name the step the reply gave: it must be the record's
            raise CorruptCheckpoint(f"ckptd answered {job} step {found.step} with the commit record of {record.step}")

        def remote_meta(rank: int) -> bytes:
            return self._daemon.shard_record(job, record.step, rank)

        def remote_runs(rank: int, runs: list[ByteRange]) -> Iterator[bytes]:
            return self._daemon.shard_runs(job, record.step, rank, runs)

        local = dict(enumerate(found.ranks))
        reader = StepReader(job, record.step, record.shard_meta_xxh3_128, local, (remote_meta, remote_runs))
        index = checked_index(found.index_json, record, f"index of {job} step {record.step}")
        return reader, index, found
