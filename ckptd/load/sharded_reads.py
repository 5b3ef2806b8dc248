"""Serve sharded loads: a step's index and where each rank's shard lies here, and ranges of the others' shards.

A client loading into a sharded state (ckpt.reshard) calls LocateStep once, then
reads the ranks this node holds straight from their files, and asks ReadShard for
ranges of the ranks it does not hold. Both RPCs call in here on the event loop;
everything that reads a disk, a peer or the store runs on the locator's threads.
A step's index is read where a tier keeps one (written at commit where a tier holds
every rank's record) or else built from the ranks' records, from the fastest tier
holding each, and kept for the next rank that asks (the last INDEX_CACHE_STEPS).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator

from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, InvalidArgument, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, digest
from ckpt_core.history import History, Line
from ckpt_core.shard_io import ShardSource
from ckpt_core.step_index import index_bytes

from ckptd.cluster.view import ClusterView
from ckptd.load.fetch import aligned_buffer
from ckptd.load.locate import Locator
from ckptd.tiers.base import Tier

log = logging.getLogger(__name__)

INDEX_CACHE_STEPS = 8
FETCH_RANGE_BYTES = 64 << 20  # a range asked for is fetched and sent about this much at a time (whole chunks)


class ShardedReads:
    """Answer LocateStep and ReadShard for one node."""

    def __init__(self, locator: Locator, view: ClusterView | None, remote_tiers: list[Tier]) -> None:
        """view: the cluster view (None: no cluster); remote_tiers: the tiers that reach beyond this node, in the
        order a range is fetched from them (the peers', the object store's)."""
        self.locator = locator
        self.view = view
        self.remote_tiers = remote_tiers
        self._indexes: OrderedDict[tuple[str, int], tuple[tuple[str, ...], bytes]] = OrderedDict()

    async def locate_step(
        self, job: str, step: int | None, tier: str = "auto"
    ) -> tuple[CommitRecord, bytes, list[list[ShardSource]], Line]:
        """Return (commit record, sealed index, this node's sources of each rank's shard, the line a save after the
        load continues) of a complete step (None: the job's head)."""
        locator = self.locator
        tiers = locator.tiers_for(tier)
        known = await locator.known_steps(job, step, tier)
        if step is None and known.lines:
            step = History.of(known.lines).head
        if step is None or step not in known.steps:
            from_object = tier in ("", "auto", "object") and locator.object_tier is not None
            raise await locator.not_complete(job, step, tier, known.steps, from_object)
        record = await self._record(job, step)
        sources = await locator.on_locate_threads(
            lambda: [locator.local_sources(tiers, job, step, r, record) for r in range(record.world_size)]
        )
        index = await self._index(record)
        locator.lease_for_reading(job, step)
        return record, index, sources, locator.next_line(job, record, known)

    async def _record(self, job: str, step: int) -> CommitRecord:
        """Return a complete step's commit record: this node's, the view's, else the first peer's or the store's."""
        view = self.view  # on the event loop: it knows recent steps without asking every peer
        known = view.commit_record(job, step) if view is not None else None
        record: CommitRecord = await self.locator.on_locate_threads(self._commit_record, job, step, known)
        return record

    def _commit_record(self, job: str, step: int, known: CommitRecord | None) -> CommitRecord:
        record = self.locator.commit_record_here(job, step) or known
        if record is not None:
            return record
        for t in self.remote_tiers:
            try:
                return t.commit_record(job, step)
            except CheckpointError:
                continue
        raise NotFound(f"{job} step {step} is not complete on any tier")

    async def _index(self, record: CommitRecord) -> bytes:
        key = (record.job, record.step)
        cached = self._indexes.get(key)
        # Kept with the records it was made from: a step saved again since is another step.
        if cached is not None and cached[0] == record.shard_meta_xxh3_128:
            self._indexes.move_to_end(key)
            return cached[1]
        data: bytes = await self.locator.on_object_threads(self._read_or_build_index, record)
        self._indexes[key] = (record.shard_meta_xxh3_128, data)
        while len(self._indexes) > INDEX_CACHE_STEPS:
            self._indexes.popitem(last=False)
        return data

    def _read_or_build_index(self, record: CommitRecord) -> bytes:
        """Return the step's index as a tier keeps it, or built from the ranks' records (b"" if none is sharded)."""
        for t in [*self.locator.tiers, *self.remote_tiers]:
            try:
                data = t.read_index(record)
            except (CheckpointError, OSError) as e:
                log.warning("%s; building the index from the shard records", e)
                continue
            if data is not None:
                return data
        return index_bytes(record, lambda rank: self._meta(record, rank)) or b""

    def _meta(self, record: CommitRecord, rank: int) -> ShardMeta:
        errors = []
        for t in [*self.locator.tiers, *self.remote_tiers]:
            try:
                if t in self.locator.tiers and not t.has_shard(record.job, record.step, rank):
                    continue
                meta = t.read_meta(record.job, record.step, rank)
                if digest(meta.to_bytes()) == record.shard_meta_xxh3_128[rank]:
                    return meta
                errors.append(f"tier {t.name} holds another record of rank {rank}")
            except CheckpointError as e:
                errors.append(str(e))
        raise NotFound(f"rank {rank} shard record of {record.job} step {record.step}: " + "; ".join(errors))

    async def read_shard(self, job: str, step: int, rank: int, ranges: list[ByteRange]) -> AsyncIterator[bytes]:
        """Yield a rank's sealed shard record, then the bytes of each range (in blocks of about FETCH_RANGE_BYTES),
        fetched from the peers or the store; the servicer cuts them into messages."""
        locator = self.locator
        record = await self._record(job, step)
        if not 0 <= rank < record.world_size:
            raise InvalidArgument(f"{job} step {step} has no rank {rank} (world_size {record.world_size})")
        meta: ShardMeta = await locator.on_object_threads(self._meta, record, rank)
        for r in ranges:
            if r.offset < 0 or r.offset % meta.chunk_size_bytes or r.length < 0 or r.end > meta.data_size_bytes:
                raise InvalidArgument(f"rank {rank} shard of {job} step {step}: no range {r}")
        yield meta.to_bytes()
        piece_bytes = max(1, FETCH_RANGE_BYTES // meta.chunk_size_bytes) * meta.chunk_size_bytes
        for r in ranges:
            for at in range(r.offset, r.end, piece_bytes):
                data, bad_tiers = await locator.on_object_threads(
                    self._fetch, meta, ByteRange(at, min(piece_bytes, r.end - at))
                )
                for name in bad_tiers:
                    locator.verification_failed(name)
                yield data

    def _fetch(self, meta: ShardMeta, byte_range: ByteRange) -> tuple[bytes, list[str]]:
        """Return a range of a shard from the first tier beyond this node whose copy checks, and the failed tiers."""
        errors: list[str] = []
        bad_tiers: list[str] = []
        offset, length = byte_range.offset, byte_range.length
        for t in self.remote_tiers:
            with aligned_buffer(length) as buffer:
                try:
                    t.read_into(meta, buffer, byte_range)
                    log.info(
                        "read bytes %d-%d of rank %d shard of %s step %d from tier %s (verified)",
                        *(offset, offset + length - 1, meta.rank, meta.job, meta.step, t.name),
                    )
                    return bytes(buffer[:length]), bad_tiers
                except CorruptCheckpoint as e:
                    bad_tiers.append(t.name)
                    log.warning("%s; trying the next copy", e)
                    errors.append(str(e))
                except CheckpointError as e:
                    errors.append(str(e))
        what = f"rank {meta.rank} shard of {meta.job} step {meta.step}, bytes {offset}-{offset + length - 1}"
        raise CorruptCheckpoint(f"{what}: no other node or store holds a good copy: " + "; ".join(errors))
