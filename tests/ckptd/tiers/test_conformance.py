"""Every tier keeps the same promises: only complete steps are listed, and every shard reads back verified.

A new tier joins by adding a harness below: how to put one rank's shard into it,
and how to change one of its stored bytes (so a test can damage it); a tier that
removes steps also says what it stores (so a test can see that nothing is left).
A durable tier also keeps ShardWrite's promises (the tests at the end).
"""

from __future__ import annotations

import asyncio
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ckpt_core.byte_range import WHOLE, ByteRange, ToEnd
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument, NotFound
from ckpt_core.format import (
    CHUNK_SIZE_BYTES,
    CommitRecord,
    ShardMeta,
    chunk_ranges,
    data_name,
    digest,
    meta_name,
    round_up,
)
from ckpt_core.shard_key import ShardKey

from ckptd.errors import ShardWriteError, StepChanged
from ckptd.save.staging import SlotPool, Snapshot
from ckptd.save.uploading import upload_file
from ckptd.storage.object_store import open_store
from ckptd.tiers.base import Listed, Tier
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object.keys import shard_dir
from ckptd.tiers.object.tier import ObjectTier
from ckptd.tiers.replica_store import ReplicaStore

THREADS = ThreadPoolExecutor(8)  # the pools Executors gives the tiers here: slot_memory, object_reads, object_requests


def _aligned(payload: bytes) -> memoryview:
    m = mmap.mmap(-1, round_up(max(len(payload), 1), 4096))
    m[: len(payload)] = payload
    return memoryview(m)


class NvmeHarness:
    def __init__(self, tmp: Path) -> None:
        self.tier = LocalDirTier(tmp / "nvme")

    def put(self, key: ShardKey, payload: bytes) -> None:
        meta = ShardMeta(key.job, key.step, key.rank, key.world_size, len(payload), CHUNK_SIZE_BYTES, (), "{}")
        self.tier.write_shard(meta, _aligned(payload))
        self.tier.try_commit(key.job, key.step, key.world_size)

    def damage(self, job: str, step: int, rank: int, offset: int) -> None:
        _flip(self.tier.shard_source(job, step, rank).data_path(rank), offset)

    def stored(self) -> list[str]:
        """Return every file under the tier's root."""
        return sorted(str(p.relative_to(self.tier.root)) for p in self.tier.root.rglob("*") if not p.is_dir())


class ObjectHarness:
    """The object tier, over file:// or a real S3 endpoint: shards go up from a scratch NVMe tier."""

    def __init__(self, tmp: Path, url: str, storage_options: dict) -> None:
        self.scratch = LocalDirTier(tmp / "scratch")
        self.tier = ObjectTier(open_store(url, storage_options), THREADS, THREADS)
        self.metas: dict[tuple[str, int], dict[int, ShardMeta]] = {}

    def put(self, key: ShardKey, payload: bytes) -> None:
        meta = ShardMeta(key.job, key.step, key.rank, key.world_size, len(payload), CHUNK_SIZE_BYTES, (), "{}")
        meta = self.scratch.write_shard(meta, _aligned(payload))
        upload_file(self.tier, meta, (self.scratch.root / key.job / str(key.step)) / data_name(key.rank))
        metas = self.metas.setdefault((key.job, key.step), {})
        metas[key.rank] = meta
        if len(metas) == key.world_size:
            digests = tuple(digest(metas[r].to_bytes()) for r in range(key.world_size))
            size = sum(m.data_size_bytes for m in metas.values())
            assert self.tier.adopt_commit(CommitRecord(key.job, key.step, key.world_size, digests, size))

    def damage(self, job: str, step: int, rank: int, offset: int) -> None:
        directory = shard_dir(job, step, rank, self.tier.keys)
        data = bytearray(self.tier.store.read(*directory, data_name(rank)))
        data[offset] ^= 1
        self.tier.store.put(bytes(data), *directory, data_name(rank))

    def stored(self) -> list[str]:
        """Return every object in the store, and every unfinished upload."""
        store = self.tier.store
        return sorted([p[len(store.root) + 1 :] for p in store.fs.find(store.root)] + store.unfinished_uploads())


class MemoryHarness:
    def __init__(self, tmp: Path) -> None:
        self.pool = SlotPool(tmp / "staging", budget_bytes=0, policy="block", memory_threads=THREADS)
        self.pool.recover()
        self.tier = MemoryTier(self.pool.slots)

    def put(self, key: ShardKey, payload: bytes) -> None:
        slot = asyncio.run(self.pool.reserve(key.job, key.rank, len(payload))).slot
        assert slot is not None
        with open(slot.path, "r+b") as f:
            f.write(payload)
        self.pool.commit(Snapshot(key, str(slot.path), slot.reservation, len(payload), "{}"))
        chunks = tuple(digest(payload[o : o + n]) for o, n in chunk_ranges(len(payload)))
        meta = ShardMeta(key.job, key.step, key.rank, key.world_size, len(payload), CHUNK_SIZE_BYTES, chunks, "{}")
        self.pool.record_hashed(slot, meta)

    def damage(self, job: str, step: int, rank: int, offset: int) -> None:
        _flip(self.tier.shard_source(job, step, rank).data_path(rank), offset)

    def close(self) -> None:
        pass


@pytest.fixture(params=["nvme", "memory", "object-file", "object-s3", "object-fsspec"])
def harness(request, tmp_path):
    if request.param == "nvme":
        h = NvmeHarness(tmp_path)
    elif request.param == "memory":
        h = MemoryHarness(tmp_path)
    elif request.param == "object-file":
        h = ObjectHarness(tmp_path, f"file://{tmp_path}/store", {})
    elif request.param == "object-fsspec":  # any other fsspec backend: its in-memory one
        h = ObjectHarness(tmp_path, f"memory://{tmp_path.name}/store", {})
    else:
        server = request.getfixturevalue("s3_server")
        h = ObjectHarness(tmp_path, f"s3://{server.new_bucket()}/p", server.storage_options)
    return h


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def _read(tier: Tier, job: str, step: int, rank: int) -> bytes:
    meta = tier.read_meta(job, step, rank)
    buf = _aligned(b"\0" * meta.data_size_bytes)
    tier.read_into(meta, buf)
    return bytes(buf[: meta.data_size_bytes])


def test_a_step_is_listed_only_once_every_rank_is_in(harness):
    harness.put(ShardKey("job", 7, 0, 2), b"rank zero")
    assert harness.tier.complete_steps("job") == []
    with pytest.raises(NotFound):
        harness.tier.commit_record("job", 7)
    harness.put(ShardKey("job", 7, 1, 2), b"rank one!")
    assert harness.tier.complete_steps("job") == [7]
    assert harness.tier.jobs() == ["job"]
    record = harness.tier.commit_record("job", 7)
    assert (record.world_size, record.size_bytes) == (2, 18)


def test_every_shard_reads_back_verified(harness):
    payloads = [os.urandom(CHUNK_SIZE_BYTES + 1000), b"", os.urandom(17)]
    for rank, payload in enumerate(payloads):
        harness.put(ShardKey("job", 1, rank, 3), payload)
    for rank, payload in enumerate(payloads):
        assert _read(harness.tier, "job", 1, rank) == payload


def test_a_byte_request_reads_just_its_bytes_verified(harness):
    payload = os.urandom(3 * CHUNK_SIZE_BYTES + 99)
    harness.put(ShardKey("job", 4, 0, 1), payload)
    meta = harness.tier.read_meta("job", 4, 0)
    for wanted, expected in [
        (ByteRange(CHUNK_SIZE_BYTES, CHUNK_SIZE_BYTES), payload[CHUNK_SIZE_BYTES : 2 * CHUNK_SIZE_BYTES]),
        (ToEnd(2 * CHUNK_SIZE_BYTES), payload[2 * CHUNK_SIZE_BYTES :]),  # the short last chunk included
        (WHOLE, payload),
    ]:
        buf = _aligned(b"\0" * len(expected))
        harness.tier.read_into(meta, buf, wanted)
        assert bytes(buf[: len(expected)]) == expected, wanted


def test_steps_are_listed_oldest_first_per_job(harness):
    for job, step in (("a", 5), ("a", 3), ("b", 9)):
        harness.put(ShardKey(job, step, 0, 1), job.encode() * step)
    assert harness.tier.complete_steps("a") == [3, 5]
    assert harness.tier.complete_steps("b") == [9]
    assert harness.tier.complete_steps("c") == []


def test_a_damaged_byte_is_an_error_naming_the_tier(harness):
    harness.put(ShardKey("job", 2, 0, 1), os.urandom(2 * CHUNK_SIZE_BYTES))
    harness.damage("job", 2, 0, CHUNK_SIZE_BYTES + 1)
    with pytest.raises(CorruptCheckpoint, match=rf"on tier {harness.tier.name}.*chunk 1"):
        _read(harness.tier, "job", 2, 0)


def test_removing_a_step_leaves_nothing_of_it(harness):
    if not hasattr(harness, "stored"):
        pytest.skip("the memory tier removes no steps: its slots are reused")
    harness.put(ShardKey("job", 3, 0, 2), b"rank zero")
    harness.put(ShardKey("job", 3, 1, 2), b"rank one")
    harness.put(ShardKey("job", 4, 0, 2), b"a step never complete")
    assert harness.tier.complete_steps("job") == [3] and harness.tier.all_steps("job") == [3, 4]
    harness.tier.remove_step("job", 3)
    harness.tier.remove_step("job", 4)
    assert harness.stored() == []


def test_a_step_retention_listed_goes_only_while_it_is_as_listed(harness):
    if not hasattr(harness, "stored"):
        pytest.skip("the memory tier removes no steps: its slots are reused")
    harness.put(ShardKey("job", 3, 0, 1), b"complete on the first line")
    harness.put(ShardKey("job", 4, 0, 2), b"a step never complete")
    with pytest.raises(StepChanged, match=rf"job step 3 on tier {harness.tier.name} changed .*incomplete then"):
        harness.tier.remove_step("job", 3, Listed(None))
    with pytest.raises(StepChanged, match=r"job step 4 .* changed since it was listed \(complete then\)"):
        harness.tier.remove_step("job", 4, Listed(()))
    with pytest.raises(StepChanged, match=r"job step 3 .* changed"):
        harness.tier.remove_step("job", 3, Listed(((2, 1),)))  # listed complete on a line it is not on
    assert harness.tier.complete_steps("job") == [3] and harness.tier.all_steps("job") == [3, 4]
    harness.tier.remove_step("job", 3, Listed(()))
    harness.tier.remove_step("job", 4, Listed(None))
    assert harness.stored() == []


def test_a_written_tier_adopts_a_commit_record_made_elsewhere_through_its_catalog(harness, tmp_path):
    # How the object store gets NVMe's record (the Uploader), and a node the step it holds part of (the save path).
    if not hasattr(harness, "stored"):
        pytest.skip("the memory tier is no catalog: its steps are the slots'")
    elsewhere = LocalDirTier(tmp_path / "elsewhere")
    payloads = [os.urandom(CHUNK_SIZE_BYTES + 5), b"rank one"]
    metas = []
    for rank, payload in enumerate(payloads):
        meta = ShardMeta("job", 5, rank, 2, len(payload), CHUNK_SIZE_BYTES, (), "{}")
        metas.append(elsewhere.write_shard(meta, _aligned(payload)))
    record = elsewhere.try_commit("job", 5, 2)
    assert record is not None
    for meta, payload in zip(metas, payloads, strict=True):
        harness.tier.write_shard(meta, _aligned(payload))
    assert harness.tier.all_steps("job") == [5] and harness.tier.complete_steps("job") == []
    assert harness.tier.adopt_commit(record)
    assert harness.tier.complete_steps("job") == [5] and harness.tier.commit_record("job", 5) == record
    assert harness.tier.adopt_commit(record), "the same record again is no change"
    assert [_read(harness.tier, "job", 5, rank) for rank in (0, 1)] == payloads


# -- ShardWrite: the one way bytes enter a durable tier ---------------------------------
# A durable tier joins by adding a fixture param that builds it (the object tier's
# ShardWrite writes ranges in order from one thread: these tests write out of order).

SMALL_CHUNK = 64 << 10


@pytest.fixture(params=["nvme", "replica-store"])
def durable(request, tmp_path):
    return LocalDirTier(tmp_path / "nvme") if request.param == "nvme" else ReplicaStore(tmp_path / "peer")


def _shard(size: int, with_checksums: bool = True) -> tuple[ShardMeta, bytes]:
    data = os.urandom(size)
    digests = tuple(digest(data[o : o + n]) for o, n in chunk_ranges(size, SMALL_CHUNK)) if with_checksums else ()
    return ShardMeta("job", 1, 0, 1, size, SMALL_CHUNK, digests, "{}"), data


def _temporaries(tier: LocalDirTier) -> list[Path]:
    return list(tier.root.rglob("*.partial"))


@pytest.mark.parametrize("with_checksums", [True, False], ids=["checked", "hashed"])
def test_ranges_written_out_of_order_from_threads_make_the_shard_write_shard_makes(durable, tmp_path, with_checksums):
    meta, data = _shard(9 * SMALL_CHUNK + 1234, with_checksums)  # a last chunk that ends mid-4 KiB
    ranges = [ByteRange(o, n) for o, n in chunk_ranges(len(data), 2 * SMALL_CHUNK)]
    shard = durable.open_shard(meta, "ab" * 8)
    with ThreadPoolExecutor(4) as threads:
        list(threads.map(lambda r: shard.write(r, memoryview(data)[r.offset : r.end]), reversed(ranges)))
    sealed = shard.seal()
    assert durable.try_commit("job", 1, 1) is not None

    whole = LocalDirTier(tmp_path / "whole")
    expected = whole.write_shard(meta, _aligned(data))
    assert sealed == expected and len(sealed.chunk_xxh3_128) == 10
    step, whole_step = (durable.root / "job" / "1"), (whole.root / "job" / "1")
    for name in (data_name(0), meta_name(0)):
        assert (step / name).read_bytes() == (whole_step / name).read_bytes()
    assert _read(durable, "job", 1, 0) == data
    assert _temporaries(durable) == []


def test_a_seal_with_a_chunk_missing_is_refused_and_nothing_counts(durable):
    meta, data = _shard(4 * SMALL_CHUNK)
    shard = durable.open_shard(meta)
    for r in (ByteRange(0, SMALL_CHUNK), ByteRange(2 * SMALL_CHUNK, 2 * SMALL_CHUNK)):
        shard.write(r, memoryview(data)[r.offset : r.end])
    with pytest.raises(InvalidArgument, match="1 chunks never arrived"):
        shard.seal()
    shard.abandon()
    assert not durable.has_shard("job", 1, 0) and durable.try_commit("job", 1, 1) is None
    assert _temporaries(durable) == []


def test_a_step_listed_incomplete_is_not_removed_while_a_copy_into_it_is_under_way(durable):
    # A shard of it opened since the listing (a flush, a replica arriving): the removal would take its directory.
    meta, data = _shard(2 * SMALL_CHUNK)
    shard = durable.open_shard(meta)
    with pytest.raises(StepChanged, match=r"job step 1 on tier .* is being written since it was listed"):
        durable.remove_step("job", 1, Listed(None))
    shard.write(ByteRange(0, len(data)), memoryview(data))
    shard.seal()
    assert durable.try_commit("job", 1, 1) is not None and _read(durable, "job", 1, 0) == data


def test_an_abandoned_write_leaves_no_temporary_file(durable):
    meta, data = _shard(2 * SMALL_CHUNK)
    shard = durable.open_shard(meta, "cd" * 8)
    shard.write(ByteRange(0, SMALL_CHUNK), memoryview(data)[:SMALL_CHUNK])
    assert len(_temporaries(durable)) == 1
    shard.abandon()
    shard.abandon()  # safe twice
    assert _temporaries(durable) == [] and not durable.has_shard("job", 1, 0)
    with pytest.raises(ShardWriteError, match="abandoned"):
        shard.write(ByteRange(SMALL_CHUNK, SMALL_CHUNK), memoryview(data)[SMALL_CHUNK:])


def test_a_bad_chunk_is_refused_and_nothing_counts(durable):
    meta, data = _shard(3 * SMALL_CHUNK)
    bad = bytearray(data)
    bad[SMALL_CHUNK + 3] ^= 1
    shard = durable.open_shard(meta)
    with pytest.raises(CorruptCheckpoint, match=r"on tier .*chunk 1 .*checksum mismatch"):
        shard.write(ByteRange.whole(len(bad)), memoryview(bad))
    shard.abandon()
    with pytest.raises(ShardWriteError, match=r"chunk 1 .*checksum mismatch"):  # write_shard: the caller's own bytes
        durable.write_shard(meta, _aligned(bytes(bad)))
    assert not durable.has_shard("job", 1, 0) and _temporaries(durable) == []
