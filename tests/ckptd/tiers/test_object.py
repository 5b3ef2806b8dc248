"""The object tier over a real S3 endpoint (moto's server) and over file://: upload, commit, read, remove."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from ckpt.errors import CorruptCheckpoint, NotFound
from ckpt.format import CHUNK_SIZE_BYTES, COMMIT_NAME, CommitRecord, ShardMeta, data_name, digest, meta_name, round_up

from ckptd.offline.verify import verify
from ckptd.storage.object_store import open_store
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object import CommitConflict, ObjectTier
from ckptd.tiers.object_layout import PART_BYTES, frames_name, zstd_name


@pytest.fixture(params=["file", "s3"])
def tier(request, tmp_path) -> ObjectTier:
    if request.param == "file":
        return ObjectTier(open_store(f"file://{tmp_path}/store", {}))
    server = request.getfixturevalue("s3_server")
    return ObjectTier(open_store(f"s3://{server.new_bucket()}/prefix", server.storage_options))


class Shards:
    """Shards written to a local NVMe tier, the way the daemon has them before it uploads."""

    def __init__(self, root: Path) -> None:
        self.nvme = LocalDirTier(root)

    def write(self, job: str, step: int, rank: int, world_size: int, payload: bytes) -> ShardMeta:
        m = mmap.mmap(-1, round_up(max(len(payload), 1), 4096))
        m[: len(payload)] = payload
        meta = ShardMeta(job, step, rank, world_size, len(payload), CHUNK_SIZE_BYTES, (), "{}")
        return self.nvme.write_shard(meta, memoryview(m))

    def path(self, meta: ShardMeta) -> Path:
        return self.nvme.step_dir(meta.job, meta.step) / data_name(meta.rank)


@pytest.fixture
def shards(tmp_path) -> Shards:
    return Shards(tmp_path / "nvme")


def _record(metas: list[ShardMeta]) -> CommitRecord:
    first = metas[0]
    return CommitRecord(
        first.job,
        first.step,
        first.world_size,
        tuple(digest(m.to_bytes()) for m in metas),
        sum(m.data_size_bytes for m in metas),
    )


def _read(tier: ObjectTier, job: str, step: int, rank: int) -> bytes:
    meta = tier.read_meta(job, step, rank)
    buf = memoryview(mmap.mmap(-1, round_up(max(meta.data_size_bytes, 1), 4096)))
    tier.read_into(meta, buf)
    return bytes(buf[: meta.data_size_bytes])


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_step_is_listed_only_through_its_commit_record_and_reads_back_bit_for_bit(tier, shards, compression):
    payloads = [os.urandom(PART_BYTES + 3 * CHUNK_SIZE_BYTES + 17), b"\0" * (2 * CHUNK_SIZE_BYTES + 5), b""]
    metas = [shards.write("job", 4, r, 3, p) for r, p in enumerate(payloads)]
    record = _record(metas)
    for meta in metas[:2]:
        tier.upload_shard(meta, shards.path(meta), compression)
    assert not tier.try_commit(record), "committed with rank 2 missing"
    assert tier.complete_steps("job") == [] and tier.all_steps("job") == [4]
    with pytest.raises(NotFound):
        tier.read_meta("job", 4, 0)
    tier.upload_shard(metas[2], shards.path(metas[2]), compression)
    assert tier.try_commit(record)
    assert tier.complete_steps("job") == [4] and tier.jobs() == ["job"]
    assert tier.commit_record("job", 4) == record
    for rank, payload in enumerate(payloads):
        assert _read(tier, "job", 4, rank) == payload
    names = tier.store.names("job", "4")
    if compression == "zstd":
        assert zstd_name(1) in names and frames_name(1) in names and data_name(1) not in names
        assert names[zstd_name(1)] < 1 << 20, "zeros were not compressed"
    else:
        assert names[data_name(0)] == len(payloads[0])


def test_two_writers_never_commit_different_records(tier, shards):
    meta = shards.write("job", 1, 0, 1, b"the one shard")
    tier.upload_shard(meta, shards.path(meta), "none")
    record = _record([meta])
    assert tier.try_commit(record)
    assert tier.try_commit(record), "the same record again is not a conflict"
    other = CommitRecord("job", 1, 1, record.shard_meta_xxh3_128, record.size_bytes + 1)
    with pytest.raises(CommitConflict):
        tier.try_commit(other)
    assert not tier.store.create(other.to_bytes(), "job", "1", COMMIT_NAME), "the store is not create-only"
    assert tier.store.read("job", "1", COMMIT_NAME) == record.to_bytes()


def test_a_changed_byte_in_the_store_is_an_error_naming_the_shard_and_tier(tier, shards):
    meta = shards.write("job", 2, 0, 1, os.urandom(3 * CHUNK_SIZE_BYTES))
    tier.upload_shard(meta, shards.path(meta), "none")
    assert tier.try_commit(_record([meta]))
    data = bytearray(tier.store.read("job", "2", data_name(0)))
    data[CHUNK_SIZE_BYTES + 7] ^= 1
    tier.store.put(bytes(data), "job", "2", data_name(0))
    with pytest.raises(CorruptCheckpoint, match=r"rank 0 shard of job step 2 on tier object.*chunk 1"):
        _read(tier, "job", 2, 0)


def test_a_local_copy_that_changed_is_never_uploaded(tier, shards):
    meta = shards.write("job", 3, 0, 1, os.urandom(CHUNK_SIZE_BYTES + 1))
    with open(shards.path(meta), "r+b") as f:
        f.write(b"X")
    with pytest.raises(CorruptCheckpoint, match="chunk 0 of the local copy"):
        tier.upload_shard(meta, shards.path(meta), "none")
    assert not tier.has_shard("job", 3, 0)


def test_removing_a_step_unlists_it_first_and_leaves_nothing(tier, shards):
    for step in (1, 2):
        meta = shards.write("job", step, 0, 1, b"x" * 100)
        tier.upload_shard(meta, shards.path(meta), "zstd")
        assert tier.try_commit(_record([meta]))
    tier.remove_step("job", 1)
    assert tier.complete_steps("job") == [2]
    assert tier.all_steps("job") == [2]


def test_an_upload_abandoned_by_a_crash_is_aborted_by_the_next_upload(s3_server, shards):
    bucket = s3_server.new_bucket()
    tier = ObjectTier(open_store(f"s3://{bucket}/p", s3_server.storage_options))
    meta = shards.write("job", 5, 0, 1, os.urandom(2 * PART_BYTES + 1))
    s3 = s3_server.client()
    s3.create_multipart_upload(Bucket=bucket, Key=f"p/job/5/{data_name(0)}")  # what a killed daemon leaves
    tier.upload_shard(meta, shards.path(meta), "none")
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert tier.try_commit(_record([meta]))
    assert tier.holds(meta)


def test_verify_reports_a_rank_missing_from_the_store_even_on_a_node_with_peers(tier, shards):
    metas = [shards.write("job", 6, r, 2, os.urandom(1000)) for r in range(2)]
    for meta in metas:
        tier.upload_shard(meta, shards.path(meta), "none")
    assert tier.try_commit(_record(metas))
    tier.store.remove("job", "6", data_name(1))
    tier.store.remove("job", "6", meta_name(1))
    checks = list(verify([tier], "job", 6, spread=True))  # spread: a node's own tiers hold some ranks, not the store
    assert [(c.rank, c.ok) for c in checks] == [(0, True), (1, False)]
    assert "missing from a complete step" in checks[1].error


class _RemovedOnSight(dict):
    """A record cache from which another thread removes an entry the moment it is checked for."""

    def __contains__(self, key: object) -> bool:
        found = super().__contains__(key)
        self.pop(key, None)  # as remove_step or a listing on another thread would, right then
        return found


def test_records_removed_by_another_thread_meanwhile_are_read_again(tier, shards):
    metas = [shards.write("job", 5, 0, 1, os.urandom(100))]
    tier.upload_shard(metas[0], shards.path(metas[0]), "none")
    assert tier.try_commit(_record(metas))
    assert tier.complete_steps("job") == [5]  # the record is cached now
    tier._records = _RemovedOnSight(tier._records)
    assert tier.complete_steps("job") == [5]  # never a KeyError out of the cache


def test_a_record_removed_right_after_the_listing_is_read_again(tier, shards):
    metas = [shards.write("job", 6, 0, 1, os.urandom(100))]
    tier.upload_shard(metas[0], shards.path(metas[0]), "none")
    assert tier.try_commit(_record(metas))
    assert tier.complete_steps("job") == [6]  # the record is cached now
    listed = tier._steps

    def listed_then_removed(job: str) -> list[int]:
        steps = listed(job)
        tier._records.pop((job, 6), None)  # another thread's removal, right after the listing
        return steps

    tier._steps = listed_then_removed
    assert tier.complete_steps("job") == [6]
    assert ("job", 6) in tier._records  # read from the store again, and kept


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_range_of_a_shard_is_read_alone_from_the_store(tier, shards, compression):
    payload = os.urandom(5 * CHUNK_SIZE_BYTES + 99)
    meta = shards.write("job", 2, 0, 1, payload)
    tier.upload_shard(meta, shards.path(meta), compression)
    assert tier.try_commit(_record([meta]))
    for offset, length in [(CHUNK_SIZE_BYTES, 2 * CHUNK_SIZE_BYTES), (4 * CHUNK_SIZE_BYTES, CHUNK_SIZE_BYTES + 99)]:
        buf = memoryview(mmap.mmap(-1, round_up(length, 4096)))
        tier.read_into(tier.read_meta("job", 2, 0), buf, offset, length)
        assert bytes(buf[:length]) == payload[offset : offset + length]


def test_a_damaged_commit_record_is_not_complete_and_is_logged_once(tier, shards, caplog):
    meta = shards.write("job", 2, 0, 1, b"a shard")
    tier.upload_shard(meta, shards.path(meta), "none")
    record = _record([meta])
    assert tier.try_commit(record) and tier.is_complete("job", 2)
    raw = bytearray(tier.store.read("job", "2", COMMIT_NAME))
    raw[-3] ^= 1
    tier.store.put(bytes(raw), "job", "2", COMMIT_NAME)
    assert not tier.is_complete("job", 2)  # read afresh, not the record this tier had read before
    fresh = ObjectTier(tier.store)  # another node, or this one after a restart
    for _ in range(3):  # every listing, and every question about the one step, reads it again
        assert fresh.complete_steps("job") == [] and fresh.damaged_steps("job") == [2]
        assert not fresh.is_complete("job", 2)
    assert len([r for r in caplog.records if "COMMIT.json" in r.getMessage()]) == 2  # once per tier
