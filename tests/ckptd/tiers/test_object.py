"""The object tier over a real S3 endpoint (moto's server) and over file://: upload, commit, read, remove."""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash
import zstandard
from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument, NotFound
from ckpt_core.format import (
    CHUNK_SIZE_BYTES,
    COMMIT_NAME,
    JOB_RE,
    OBJECT_KEYS_VERSION,
    READABLE_VERSIONS,
    CommitRecord,
    ShardMeta,
    chunk_ranges,
    data_name,
    digest,
    meta_name,
    round_up,
    seal,
    unseal,
    validate_job,
)

from ckptd.errors import AlreadyHeld, CommitConflict
from ckptd.offline.restore import restore
from ckptd.offline.verify import verify
from ckptd.save.uploading import upload_file
from ckptd.storage.object_store import S3Store, open_store
from ckptd.tiers.base import ShardWrite
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object import shards as object_shards
from ckptd.tiers.object.keys import (
    HASHED_KEYS,
    PREFIX_HEX_DIGITS,
    SHARDS_DIR,
    all_prefixes,
    hash_prefix,
    hashed_dir,
    hashed_job_dir,
    shard_dir,
)
from ckptd.tiers.object.layout import PART_BYTES, frame_index, frames_name, zstd_name
from ckptd.tiers.object.tier import ObjectTier

THREADS = ThreadPoolExecutor(8, thread_name_prefix="object")  # Executors.object_reads and object_requests, here


@pytest.fixture(params=["file", "s3"])
def tier(request, tmp_path) -> ObjectTier:
    if request.param == "file":
        return ObjectTier(open_store(f"file://{tmp_path}/store", {}), THREADS, THREADS)
    server = request.getfixturevalue("s3_server")
    return ObjectTier(open_store(f"s3://{server.new_bucket()}/prefix", server.storage_options), THREADS, THREADS)


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
        return (self.nvme.root / meta.job / str(meta.step)) / data_name(meta.rank)


@pytest.fixture
def shards(tmp_path) -> Shards:
    return Shards(tmp_path / "nvme")


def _upload(tier: ObjectTier, meta: ShardMeta, path: Path, compression: str = "none") -> bool:
    """Upload a shard from its NVMe file as the uploader does, stored as compression says ([object] compression)."""
    tier.compression = compression  # read by each open_shard: one node, its caches kept, as before
    return upload_file(tier, meta, path)


def _record(metas: list[ShardMeta]) -> CommitRecord:
    first = metas[0]
    return CommitRecord(
        first.job,
        first.step,
        first.world_size,
        tuple(digest(m.to_bytes()) for m in metas),
        sum(m.data_size_bytes for m in metas),
    )


def _dir(tier: ObjectTier, job: str, step: int, rank: int) -> tuple[str, ...]:
    """Return where an upload puts a rank's shard objects: hashed in S3, flat in a file:// store."""
    return shard_dir(job, step, rank, tier.keys)


def hashed_only(tier: ObjectTier) -> None:
    """Skip for a file:// store: it keeps the flat layout (no per-prefix limits; ckpt.load_local reads it)."""
    if tier.keys != HASHED_KEYS:
        pytest.skip("a file:// store keeps its shard objects beside the commit record")


def _stored(tier: ObjectTier) -> list[str]:
    """Return every object in the whole store, and every unfinished upload, relative to its URL."""
    root = tier.store.root
    objects = [path[len(root) + 1 :] for path in tier.store.fs.find(root)]
    return sorted(objects + tier.store.unfinished_uploads())


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
        _upload(tier, meta, shards.path(meta), compression)
    assert not tier.adopt_commit(record), "committed with rank 2 missing"
    assert tier.complete_steps("job") == [] and tier.all_steps("job") == [4]
    with pytest.raises(NotFound):
        tier.read_meta("job", 4, 0)
    _upload(tier, metas[2], shards.path(metas[2]), compression)
    assert tier.adopt_commit(record)
    assert tier.complete_steps("job") == [4] and tier.jobs() == ["job"]
    assert tier.commit_record("job", 4) == record
    for rank, payload in enumerate(payloads):
        assert _read(tier, "job", 4, rank) == payload
    names = tier.store.names(*_dir(tier, "job", 4, 1)) | tier.store.names(*_dir(tier, "job", 4, 0))
    if compression == "zstd":
        assert zstd_name(1) in names and frames_name(1) in names and data_name(1) not in names
        assert names[zstd_name(1)] < 1 << 20, "zeros were not compressed"
    else:
        assert names[data_name(0)] == len(payloads[0])


def test_two_writers_never_commit_different_records(tier, shards):
    meta = shards.write("job", 1, 0, 1, b"the one shard")
    _upload(tier, meta, shards.path(meta), "none")
    record = _record([meta])
    assert tier.adopt_commit(record)
    assert tier.adopt_commit(record), "the same record again is not a conflict"
    other = CommitRecord("job", 1, 1, record.shard_meta_xxh3_128, record.size_bytes + 1)
    with pytest.raises(CommitConflict):
        tier.adopt_commit(other)
    assert not tier.store.create(other.to_bytes(), "job", "1", COMMIT_NAME), "the store is not create-only"
    assert tier.store.read("job", "1", COMMIT_NAME) == record.to_bytes(object_keys=tier.keys)


def test_a_changed_byte_in_the_store_is_an_error_naming_the_shard_and_tier(tier, shards):
    meta = shards.write("job", 2, 0, 1, os.urandom(3 * CHUNK_SIZE_BYTES))
    _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record([meta]))
    data = bytearray(tier.store.read(*_dir(tier, "job", 2, 0), data_name(0)))
    data[CHUNK_SIZE_BYTES + 7] ^= 1
    tier.store.put(bytes(data), *_dir(tier, "job", 2, 0), data_name(0))
    with pytest.raises(CorruptCheckpoint, match=r"rank 0 shard of job step 2 on tier object.*chunk 1"):
        _read(tier, "job", 2, 0)


def test_a_local_copy_that_changed_is_never_uploaded(tier, shards):
    meta = shards.write("job", 3, 0, 1, os.urandom(CHUNK_SIZE_BYTES + 1))
    with open(shards.path(meta), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))  # changed for sure (a random first byte may be any given one)
    with pytest.raises(CorruptCheckpoint, match="chunk 0 of the local copy"):
        _upload(tier, meta, shards.path(meta), "none")
    assert not tier.has_shard("job", 3, 0)


def test_removing_a_step_unlists_it_first_and_leaves_nothing(tier, shards):
    for step in (1, 2):
        meta = shards.write("job", step, 0, 1, b"x" * 100)
        _upload(tier, meta, shards.path(meta), "zstd")
        assert tier.adopt_commit(_record([meta]))
    tier.remove_step("job", 1)
    assert tier.complete_steps("job") == [2]
    assert tier.all_steps("job") == [2]


def test_an_upload_abandoned_by_a_crash_is_aborted_by_the_next_upload(s3_server, shards):
    bucket = s3_server.new_bucket()
    tier = ObjectTier(open_store(f"s3://{bucket}/p", s3_server.storage_options), THREADS, THREADS)
    meta = shards.write("job", 5, 0, 1, os.urandom(2 * PART_BYTES + 1))
    s3 = s3_server.client()
    key = "/".join(["p", *_dir(tier, "job", 5, 0), data_name(0)])
    s3.create_multipart_upload(Bucket=bucket, Key=key)  # what a killed daemon leaves
    _upload(tier, meta, shards.path(meta), "none")
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert tier.adopt_commit(_record([meta]))
    assert tier.holds(meta)


def test_verify_reports_a_rank_missing_from_the_store_even_on_a_node_with_peers(tier, shards):
    metas = [shards.write("job", 6, r, 2, os.urandom(1000)) for r in range(2)]
    for meta in metas:
        _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record(metas))
    tier.store.remove(*_dir(tier, "job", 6, 1), data_name(1))
    tier.store.remove(*_dir(tier, "job", 6, 1), meta_name(1))
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
    _upload(tier, metas[0], shards.path(metas[0]), "none")
    assert tier.adopt_commit(_record(metas))
    assert tier.complete_steps("job") == [5]  # the record is cached now
    tier._records = _RemovedOnSight(tier._records)
    assert tier.complete_steps("job") == [5]  # never a KeyError out of the cache


def test_a_record_removed_right_after_the_listing_is_read_again(tier, shards):
    metas = [shards.write("job", 6, 0, 1, os.urandom(100))]
    _upload(tier, metas[0], shards.path(metas[0]), "none")
    assert tier.adopt_commit(_record(metas))
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
    _upload(tier, meta, shards.path(meta), compression)
    assert tier.adopt_commit(_record([meta]))
    for offset, length in [(CHUNK_SIZE_BYTES, 2 * CHUNK_SIZE_BYTES), (4 * CHUNK_SIZE_BYTES, CHUNK_SIZE_BYTES + 99)]:
        buf = memoryview(mmap.mmap(-1, round_up(length, 4096)))
        tier.read_into(tier.read_meta("job", 2, 0), buf, ByteRange(offset, length))
        assert bytes(buf[:length]) == payload[offset : offset + length]


def test_a_damaged_commit_record_is_not_complete_and_is_logged_once(tier, shards, caplog):
    meta = shards.write("job", 2, 0, 1, b"a shard")
    _upload(tier, meta, shards.path(meta), "none")
    record = _record([meta])
    assert tier.adopt_commit(record) and tier.is_complete("job", 2)
    raw = bytearray(tier.store.read("job", "2", COMMIT_NAME))
    raw[-3] ^= 1
    tier.store.put(bytes(raw), "job", "2", COMMIT_NAME)
    assert not tier.is_complete("job", 2)  # read afresh, not the record this tier had read before
    fresh = ObjectTier(tier.store, THREADS, THREADS)  # another node, or this one after a restart
    for _ in range(3):  # every listing, and every question about the one step, reads it again
        assert fresh.complete_steps("job") == [] and fresh.damaged_steps("job") == [2]
        assert not fresh.is_complete("job", 2)
    assert len([r for r in caplog.records if "COMMIT.json" in r.getMessage()]) == 2  # once per tier


def test_shard_objects_spread_over_256_hash_prefixes_and_the_step_keeps_its_commit_record(tier, shards):
    hashed_only(tier)
    assert (PREFIX_HEX_DIGITS, len(all_prefixes()), all_prefixes()[-1]) == (2, 256, "ff")
    assert hash_prefix("job", 9, 3) == xxhash.xxh3_64_hexdigest(b"job/9/3")[:2]
    world = 12
    payloads = [os.urandom(100 + rank) for rank in range(world)]
    metas = [shards.write("job", 9, rank, world, p) for rank, p in enumerate(payloads)]
    for meta in metas:
        _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record(metas))
    shard_keys = {
        f"{SHARDS_DIR}/{hash_prefix('job', 9, rank)}/job/9/{name}"
        for rank in range(world)
        for name in (data_name(rank), meta_name(rank))
    }
    assert _stored(tier) == sorted([*shard_keys, f"job/9/{COMMIT_NAME}"])  # nothing of a shard beside the record
    assert len({hash_prefix("job", 9, rank) for rank in range(world)}) > world // 2
    fresh = ObjectTier(tier.store, THREADS, THREADS)  # another node: finds every shard from its name alone
    for rank, payload in enumerate(payloads):
        assert _read(fresh, "job", 9, rank) == payload
        assert fresh.has_shard("job", 9, rank) and fresh.holds(metas[rank])


def test_the_shards_directory_is_never_taken_for_a_job(tier, shards):
    hashed_only(tier)
    assert JOB_RE.fullmatch(SHARDS_DIR) is None
    with pytest.raises(InvalidArgument):
        validate_job(SHARDS_DIR)
    meta = shards.write("job", 1, 0, 1, b"a shard")
    _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record([meta]))
    assert tier.store.names().keys() == {SHARDS_DIR, "job"}
    assert tier.jobs() == ["job"]


@pytest.mark.parametrize("version", [1, 2])
def test_a_step_of_the_flat_layout_with_an_older_record_still_lists_and_loads(tier, shards, version):
    payloads = [os.urandom(CHUNK_SIZE_BYTES + 5), b"\0" * 1000]
    metas = [shards.write("old", 3, rank, 2, p) for rank, p in enumerate(payloads)]
    record = _record(metas)
    # As a ckptd of before the hash prefixes left it: every object beside the commit record, rank 1 compressed.
    tier.store.put(payloads[0], "old", "3", data_name(0))
    frame = zstandard.ZstdCompressor().compress(payloads[1])
    tier.store.put(frame, "old", "3", zstd_name(1))
    tier.store.put(frame_index([len(frame)]), "old", "3", frames_name(1))
    for meta in metas:
        tier.store.put(meta.to_bytes(), "old", "3", meta_name(meta.rank))
    body = unseal(record.to_bytes(), "c")
    assert body["version"] == 2 and "object_keys" not in body
    tier.store.put(seal({**body, "version": version}), "old", "3", COMMIT_NAME)

    fresh = ObjectTier(tier.store, THREADS, THREADS)
    assert fresh.jobs() == ["old"] and fresh.complete_steps("old") == [3]
    assert fresh.commit_record("old", 3) == record
    for rank, payload in enumerate(payloads):
        assert fresh.has_shard("old", 3, rank)
        assert _read(fresh, "old", 3, rank) == payload
    assert [c.ok for c in verify([fresh], "old", 3)] == [True, True]
    fresh.remove_step("old", 3)
    assert _stored(fresh) == []


def test_the_stores_record_names_its_keys_in_a_version_that_readers_of_versions_1_and_2_refuse(tier, shards, tmp_path):
    meta = shards.write("job", 8, 0, 1, b"a shard")
    _upload(tier, meta, shards.path(meta), "none")
    record = _record([meta])
    assert tier.adopt_commit(record)
    raw = tier.store.read("job", "8", COMMIT_NAME)
    body = unseal(raw, "COMMIT.json")
    if tier.keys != HASHED_KEYS:  # a file:// store: flat, its step directory readable as every tier's
        assert body["version"] == 2 and "object_keys" not in body
        assert CommitRecord.from_bytes(raw, "COMMIT.json") == record
        assert (tmp_path / "store" / "job" / "8" / data_name(0)).read_bytes() == b"a shard"
        return
    assert (body["version"], body["object_keys"]) == (OBJECT_KEYS_VERSION, HASHED_KEYS) == (3, "xxh3-2hex")
    # What a reader of versions 1 and 2 checks (every ckptd before this layout, and a step directory's readers):
    assert READABLE_VERSIONS == (1, 2) and body["version"] not in READABLE_VERSIONS
    with pytest.raises(CorruptCheckpoint, match=r"not a commit record of version \(1, 2\)"):
        CommitRecord.from_bytes(raw, "COMMIT.json")
    assert CommitRecord.from_object_bytes(raw, "COMMIT.json") == (record, HASHED_KEYS)
    # The tier hands on the step's record as every other tier has it: equal, and sealed alike.
    held = ObjectTier(tier.store, THREADS, THREADS).commit_record("job", 8)
    assert held == record and held.to_bytes() == record.to_bytes()
    # Restored, the step is in the flat layout with a record of version 2, for the readers of today.
    step_dir = restore([tier], "job", 8, tmp_path / "out", progress=lambda message: None)
    restored = (step_dir / COMMIT_NAME).read_bytes()
    assert restored == record.to_bytes() and CommitRecord.from_bytes(restored, "restored") == record
    assert (step_dir / data_name(0)).read_bytes() == b"a shard"
    # Keys a ckptd does not know (a layout of a newer one) make the step damaged here, never misread.
    tier.store.put(seal({**body, "object_keys": "xxh3-3hex"}), "job", "8", COMMIT_NAME)
    newer = ObjectTier(tier.store, THREADS, THREADS)
    assert newer.complete_steps("job") == [] and newer.damaged_steps("job") == [8]


def test_a_commit_poll_lists_each_prefix_once_and_reads_only_the_records_not_found_before(tier, shards, monkeypatch):
    hashed_only(tier)
    world = 6
    metas = [shards.write("job", 5, rank, world, os.urandom(50)) for rank in range(world)]
    record = _record(metas)
    for meta in metas[:4]:
        _upload(tier, meta, shards.path(meta), "none")
    reads: list[str] = []
    listings: list[tuple[str, ...]] = []
    read, names = tier.store.read, tier.store.names
    monkeypatch.setattr(tier.store, "read", lambda *n, **kw: reads.append(n[-1]) or read(*n, **kw))
    monkeypatch.setattr(tier.store, "names", lambda *d: listings.append(d) or names(*d))
    prefixes = sorted({hash_prefix("job", 5, rank) for rank in range(world)})

    def poll() -> bool:
        reads.clear()
        listings.clear()
        done = tier.adopt_commit(record)
        assert sorted(listings) == [hashed_dir(p, "job", 5) for p in prefixes]  # each once, the step never
        return done

    assert not poll() and sorted(reads) == [meta_name(rank) for rank in range(4)]
    assert not poll() and reads == []  # ranks 0-3 matched: only their directories' listings are looked at
    tier.store.remove(*_dir(tier, "job", 5, 1), meta_name(1))  # a found rank's shard goes (saved again)...
    assert not poll() and reads == []
    tier.store.put(metas[1].to_bytes(), *_dir(tier, "job", 5, 1), meta_name(1))  # ...and comes back: read again
    assert not poll() and reads == [meta_name(1)]
    for meta in metas[4:]:
        _upload(tier, meta, shards.path(meta), "none")
    assert poll() and sorted(reads) == [meta_name(4), meta_name(5)]
    assert tier.shards._matched == {}, "what a commit remembered outlives it"


def test_listings_of_a_job_at_once_read_each_commit_record_once(tier, shards, monkeypatch):
    """After a restart (nothing cached) several callers list a long history at once: one reads, the others wait."""
    for step in range(1, 7):
        meta = shards.write("job", step, 0, 1, os.urandom(50))
        _upload(tier, meta, shards.path(meta), "none")
        assert tier.adopt_commit(_record([meta]))
    restarted = ObjectTier(tier.store, THREADS, THREADS)
    reads: list[tuple[str, ...]] = []
    read = restarted.store.read

    def slow_read(*names: str, **kw):
        if names[-1] == COMMIT_NAME:
            reads.append(names)
            time.sleep(0.05)  # a store far away: the listings overlap
        return read(*names, **kw)

    monkeypatch.setattr(restarted.store, "read", slow_read)
    start = threading.Barrier(4)

    def listing(_: int) -> list[int]:
        start.wait()
        return restarted.complete_steps("job")

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(listing, range(4))) == [[1, 2, 3, 4, 5, 6]] * 4
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 6, f"records read more than once: {reads}"


def test_removing_a_committed_and_a_never_committed_step_leaves_nothing_in_the_store(tier, shards, request):
    world = 5
    done = [shards.write("job", 1, rank, world, os.urandom(100)) for rank in range(world)]
    for meta in done:
        _upload(tier, meta, shards.path(meta), "zstd" if meta.rank % 2 else "none")
    assert tier.adopt_commit(_record(done))
    for rank in range(3):  # a crash before the commit: three ranks of five uploaded
        meta = shards.write("job", 2, rank, world, os.urandom(100))
        _upload(tier, meta, shards.path(meta), "none")
    if isinstance(tier.store, S3Store):  # and the upload cut short by the crash
        bucket, key, _ = tier.store.fs.split_path(tier.store.path(*_dir(tier, "job", 2, 4), data_name(4)))
        request.getfixturevalue("s3_server").client().create_multipart_upload(Bucket=bucket, Key=key)
    else:
        tier.store.put(b"half", *_dir(tier, "job", 2, 4), f"{data_name(4)}.0123abcd.partial")
    assert tier.all_steps("job", afresh=True) == [1, 2] and tier.complete_steps("job") == [1]
    assert tier.unfinished_steps("job") == ([2] if isinstance(tier.store, S3Store) else [])
    tier.remove_step("job", 1)  # its ranks from its record, by name
    tier.remove_step("job", 2)  # no record: what a listing of every hash prefix finds
    assert _stored(tier) == []
    assert [p for p in tier.store.fs.find(tier.store.root, withdirs=True) if p.rsplit("/", 1)[-1] in ("1", "2")] == []
    assert tier.all_steps("job") == [] and tier.all_steps("job", afresh=True) == []


def test_steps_with_shard_objects_only_are_found_by_a_scan_of_the_prefixes_kept_a_while(tier, shards, monkeypatch):
    hashed_only(tier)
    meta = shards.write("job", 1, 0, 1, b"done")
    _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record([meta]))
    assert tier.all_steps("job") == [1]
    crashed = shards.write("job", 2, 0, 2, b"never committed")
    _upload(tier, crashed, shards.path(crashed), "none")
    listings: list[tuple[str, ...]] = []
    names = tier.store.names
    monkeypatch.setattr(tier.store, "names", lambda *d: listings.append(d) or names(*d))
    assert tier.all_steps("job") == [1], "the hash prefixes were listed again within SCAN_INTERVAL_S"
    assert [d for d in listings if d[0] == SHARDS_DIR] == []
    assert tier.all_steps("job", afresh=True) == [1, 2]  # ckptd gc: now
    assert sorted(d for d in listings if d[0] == SHARDS_DIR) == [hashed_job_dir(p, "job") for p in all_prefixes()]
    tier.remove_step("job", 2)
    assert tier.all_steps("job") == [1]
    _upload(tier, crashed, shards.path(crashed), "none")
    monkeypatch.setattr(object_shards, "SCAN_INTERVAL_S", 0.0)  # the interval is over
    assert tier.all_steps("job") == [1, 2]


def test_uploads_ask_for_the_commit_record_once_per_step_and_never_write_into_a_complete_one(tier, shards, monkeypatch):
    payloads = [os.urandom(100) for _ in range(4)]
    metas = [shards.write("job", 3, rank, 4, p) for rank, p in enumerate(payloads)]
    asked: list[tuple[str, ...]] = []
    read = tier.store.read
    monkeypatch.setattr(
        tier.store, "read", lambda *n, **kw: (n[-1] == COMMIT_NAME and asked.append(n)) or read(*n, **kw)
    )
    for meta in metas:
        assert _upload(tier, meta, shards.path(meta), "none")
    assert asked == [("job", "3", COMMIT_NAME)], "one node's ranks each asked the step's prefix"
    assert tier.adopt_commit(_record(metas))
    resaved = shards.write("job", 3, 2, 4, b"another save of rank 2")
    for node in (tier, ObjectTier(tier.store, THREADS, THREADS)):  # this node, and one that never asked
        with pytest.raises(CommitConflict, match="never rewritten"):
            _upload(node, resaved, shards.path(resaved), "none")
        assert not _upload(node, metas[0], shards.path(metas[0]), "none")  # listed as it is: nothing to do
    assert _read(tier, "job", 3, 2) == payloads[2]


def test_a_store_in_the_flat_layout_never_looks_under_the_hash_prefixes(tmp_path, shards, monkeypatch):
    tier = ObjectTier(open_store(f"file://{tmp_path}/store", {}), THREADS, THREADS)
    meta = shards.write("job", 1, 0, 1, b"flat")
    _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record([meta]))
    names, uploads = tier.store.names, tier.store.unfinished_uploads
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(tier.store, "names", lambda *d: asked.append(d) or names(*d))
    monkeypatch.setattr(tier.store, "unfinished_uploads", lambda *d: asked.append(d) or uploads(*d))
    assert tier.all_steps("job", afresh=True) == [1] and tier.unfinished_steps("job") == []
    tier.remove_step("job", 1)
    assert asked and not [d for d in asked if d and d[0] == SHARDS_DIR], asked
    assert _stored(tier) == []


def test_a_damaged_commit_record_is_read_and_logged_once_while_its_step_is_listed(tier, shards, monkeypatch, caplog):
    meta = shards.write("job", 3, 0, 1, b"x")
    _upload(tier, meta, shards.path(meta), "none")
    assert tier.adopt_commit(_record([meta]))
    tier.store.put(b"not a record", "job", "3", COMMIT_NAME)
    fresh = ObjectTier(tier.store, THREADS, THREADS)
    read = fresh.store.read
    reads: list[tuple[str, ...]] = []
    monkeypatch.setattr(fresh.store, "read", lambda *n, **kw: reads.append(n) or read(*n, **kw))
    for _ in range(3):
        assert fresh.complete_steps("job") == [] and fresh.damaged_steps("job") == [3]
        assert not fresh.is_complete("job", 3)
    assert reads.count(("job", "3", COMMIT_NAME)) == 1
    assert sum("COMMIT.json" in r.getMessage() for r in caplog.records if r.levelname == "ERROR") == 1


def _checked_meta(job: str, step: int, rank: int, world_size: int, payload: bytes) -> ShardMeta:
    """Return the record of a shard of payload, with its chunks' checksums (as the flush writes it)."""
    chunks = tuple(digest(payload[o : o + n]) for o, n in chunk_ranges(len(payload)))
    return ShardMeta(job, step, rank, world_size, len(payload), CHUNK_SIZE_BYTES, chunks, "{}")


def _write_ranges(shard: ShardWrite, payload: bytes, range_bytes: int, upto: int = -1) -> None:
    """Write payload's ranges of range_bytes in order, those before byte upto (-1: all of them)."""
    for offset, length in chunk_ranges(len(payload), range_bytes):
        if 0 <= upto <= offset:
            return
        shard.write(ByteRange(offset, length), memoryview(payload)[offset : offset + length])


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_shard_written_through_open_shard_in_chunk_sized_ranges_reads_back_identical(tier, compression):
    tier.compression = compression
    payload = os.urandom(PART_BYTES + 3 * CHUNK_SIZE_BYTES) + b"\0" * (PART_BYTES + 17)  # three parts, at least
    meta = _checked_meta("job", 2, 0, 1, payload)
    shard = tier.open_shard(meta)
    assert shard.ordered
    _write_ranges(shard, payload, CHUNK_SIZE_BYTES)  # smaller than a part: the ShardWrite packs them
    assert shard.seal() == meta
    assert tier.holds(meta) and tier.adopt_commit(_record([meta]))
    assert _read(tier, "job", 2, 0) == payload
    names = tier.store.names(*_dir(tier, "job", 2, 0))
    assert (zstd_name(0) in names) == (compression == "zstd") and (data_name(0) in names) == (compression == "none")


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_an_abandoned_shard_leaves_no_object_no_temporary_and_no_unfinished_upload(tier, compression):
    tier.compression = compression
    payload = os.urandom(3 * PART_BYTES)
    meta = _checked_meta("job", 3, 0, 1, payload)
    shard = tier.open_shard(meta)
    _write_ranges(shard, payload, PART_BYTES, upto=2 * PART_BYTES)  # two parts in: a multipart upload on S3
    if isinstance(tier.store, S3Store):
        assert tier.store.unfinished_uploads() != []
    else:
        assert [p for p in tier.store.fs.find(tier.store.root) if p.endswith(".partial")] != []
    shard.abandon()
    shard.abandon()  # safe twice
    assert _stored(tier) == []
    assert not tier.has_shard("job", 3, 0) and not tier.holds(meta)


def test_a_bad_chunk_is_refused_and_nothing_of_the_shard_counts(tier):
    payload = os.urandom(PART_BYTES + 2 * CHUNK_SIZE_BYTES)
    meta = _checked_meta("job", 4, 0, 1, payload)
    changed = bytearray(payload)
    changed[PART_BYTES + CHUNK_SIZE_BYTES + 5] ^= 1
    shard = tier.open_shard(meta, transfer="/nvme/job/4/rank-00000.data")
    _write_ranges(shard, bytes(changed), PART_BYTES, upto=PART_BYTES)  # the first part is good
    bad = ByteRange(PART_BYTES, 2 * CHUNK_SIZE_BYTES)
    with pytest.raises(CorruptCheckpoint, match=r"chunk 5 of the local copy /nvme/job/4/rank-00000.data changed"):
        shard.write(bad, memoryview(bytes(changed))[bad.offset : bad.end])
    wrong = [digest(payload[bad.offset : bad.offset + CHUNK_SIZE_BYTES])] * 2  # a caller's checksums, not the record's
    with pytest.raises(CorruptCheckpoint, match="chunk 5 of the local copy"):
        shard.write(bad, memoryview(payload)[bad.offset : bad.end], digests=wrong)
    shard.abandon()
    assert _stored(tier) == []
    assert not tier.has_shard("job", 4, 0)
    assert not tier.adopt_commit(_record([meta]))


def test_a_shard_the_commit_record_lists_is_already_held_and_another_one_a_conflict(tier):
    payloads = [os.urandom(1000), os.urandom(2000)]
    metas = [_checked_meta("job", 5, rank, 2, p) for rank, p in enumerate(payloads)]
    for meta, payload in zip(metas, payloads, strict=True):
        shard = tier.open_shard(meta)
        _write_ranges(shard, payload, PART_BYTES)
        shard.seal()
    assert tier.adopt_commit(_record(metas))
    for node in (tier, ObjectTier(tier.store, THREADS, THREADS)):  # this node, and one that never uploaded
        with pytest.raises(AlreadyHeld, match="rank 1 shard of job step 5 on tier object"):
            node.open_shard(metas[1])
        with pytest.raises(CommitConflict, match="never rewritten"):
            node.open_shard(_checked_meta("job", 5, 1, 2, b"another save of rank 1"))
    assert _read(tier, "job", 5, 1) == payloads[1]
