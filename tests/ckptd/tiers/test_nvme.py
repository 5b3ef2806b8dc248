"""The NVMe tier writes shards atomically and durably, and lists a step only once committed."""

from __future__ import annotations

import mmap
import os
import shutil

import pytest
from ckpt_core.errors import CorruptCheckpoint, NotFound
from ckpt_core.format import CHUNK_SIZE_BYTES, COMMIT_NAME, ShardMeta, data_name, meta_name, round_up
from ckpt_core.shard_io import read_meta, read_shard_into

from ckptd.errors import ShardWriteError
from ckptd.tiers.nvme import LocalDirTier


def _buffer(payload: bytes) -> memoryview:
    m = mmap.mmap(-1, round_up(max(len(payload), 1), 4096))
    m[: len(payload)] = payload
    return memoryview(m)


def _meta(job="j", step=1, rank=0, world_size=2, size=0):
    return ShardMeta(job, step, rank, world_size, size, CHUNK_SIZE_BYTES, (), '{"tensors": []}')


@pytest.fixture
def tier(tmp_path):
    t = LocalDirTier(tmp_path / "root")
    yield t


def _write(tier, rank, payload, world_size=2, step=1):
    return tier.write_shard(_meta(rank=rank, world_size=world_size, step=step, size=len(payload)), _buffer(payload))


def test_step_is_listed_only_when_every_rank_is_committed(tier):
    payload = os.urandom(3 * CHUNK_SIZE_BYTES + 123)
    _write(tier, 0, payload)
    assert tier.try_commit("j", 1, 2) is None
    assert tier.complete_steps("j") == []
    _write(tier, 1, payload[::-1])
    record = tier.try_commit("j", 1, 2)
    assert record is not None and record.size_bytes == 2 * len(payload)
    assert tier.complete_steps("j") == [1]
    assert ((tier.root / "j" / "1") / data_name(0)).stat().st_size == len(payload)


def test_written_bytes_read_back_verified(tier):
    payload = os.urandom(CHUNK_SIZE_BYTES + 7)
    meta = _write(tier, 0, payload, world_size=1)
    assert len(meta.chunk_xxh3_128) == 2
    tier.try_commit("j", 1, 1)
    source = tier.shard_source("j", 1, 0)
    back = _buffer(b"\0" * len(payload))
    read_shard_into(source, read_meta(source, 0), back)
    assert bytes(back[: len(payload)]) == payload


def test_flipped_byte_is_caught_naming_shard_tier_and_chunk(tier):
    payload = os.urandom(2 * CHUNK_SIZE_BYTES)
    _write(tier, 0, payload, world_size=1)
    tier.try_commit("j", 1, 1)
    path = (tier.root / "j" / "1") / data_name(0)
    with open(path, "r+b") as f:
        f.seek(CHUNK_SIZE_BYTES + 5)
        byte = f.read(1)
        f.seek(CHUNK_SIZE_BYTES + 5)
        f.write(bytes([byte[0] ^ 1]))
    source = tier.shard_source("j", 1, 0)
    with pytest.raises(CorruptCheckpoint, match=r"rank 0 shard of j step 1 on tier nvme.*chunk 1 .*mismatch"):
        read_shard_into(source, read_meta(source, 0), _buffer(b"\0" * len(payload)))


def test_expected_checksums_are_checked_while_writing(tier):
    payload = os.urandom(100)
    meta = _write(tier, 0, payload, world_size=1)
    other = ShardMeta(**{**meta.__dict__, "step": 2})
    with pytest.raises(ShardWriteError, match="checksum mismatch"):
        tier.write_shard(other, _buffer(b"x" * 100))
    assert not (tier.root / "j" / "2").exists()  # the partial file is gone, and the directory it was alone in


def test_a_failed_copy_leaves_no_empty_step_directory_and_never_takes_one_in_use(tier):
    step_dir = tier.root / "j" / "1"
    first, second = tier.open_shard(_meta(size=100)), tier.open_shard(_meta(rank=1, size=100))
    first.abandon()
    assert second.temporary.exists()  # the directory stayed: another copy is under way in it
    second.abandon()
    assert not step_dir.exists()  # the last copy out leaves nothing behind

    _write(tier, 1, b"abc")
    tier.open_shard(_meta(size=100)).abandon()
    assert sorted(p.name for p in step_dir.iterdir()) == [data_name(1), meta_name(1)]  # a shard is in: it stays


def test_remove_step_unlists_first_and_leftovers_are_cleaned(tier):
    _write(tier, 0, b"abc", world_size=1)
    tier.try_commit("j", 1, 1)
    tier.remove_step("j", 1)
    assert tier.complete_steps("j") == [] and tier.all_steps("j") == []
    with pytest.raises(NotFound):
        tier.remove_step("j", 1)
    step_dir = tier.root / "j" / "5"
    step_dir.mkdir(parents=True)
    (step_dir / "rank-00000.data.partial").write_bytes(b"x")
    (tier.root / "j" / ".deleting-4").mkdir()
    removed = tier.remove_leftovers()
    assert len(removed) == 2 and list(step_dir.iterdir()) == []


def test_commit_record_is_checked_against_the_metadata(tier):
    _write(tier, 0, b"abc", world_size=1)
    tier.try_commit("j", 1, 1)
    meta_path = (tier.root / "j" / "1") / "rank-00000.meta.json"
    other = ShardMeta.from_bytes(meta_path.read_bytes(), "m")
    meta_path.write_bytes(ShardMeta(**{**other.__dict__, "layout_json": '{"tensors": [], "x": 1}'}).to_bytes())
    with pytest.raises(CorruptCheckpoint, match="commit record"):
        read_meta(tier.shard_source("j", 1, 0), 0)
    ((tier.root / "j" / "1") / COMMIT_NAME).unlink()
    with pytest.raises(NotFound):
        read_meta(tier.shard_source("j", 1, 0), 0)


def _write_run(tier, rank, run_id, payload=b"abc", world_size=2, step=1):
    meta = ShardMeta("j", step, rank, world_size, len(payload), CHUNK_SIZE_BYTES, (), "{}", run_id)
    return tier.write_shard(meta, _buffer(payload))


def test_shards_of_two_runs_are_never_sealed_together(tier):
    _write_run(tier, 0, "run-a")
    _write_run(tier, 1, "run-b")
    assert tier.try_commit("j", 1, 2) is None  # whatever the caller says, mixed runs are not sealed
    assert tier.try_commit("j", 1, 2, run_id="run-b") is None  # the latest run's view: run a's shard goes
    assert not tier.has_shard("j", 1, 0) and tier.has_shard("j", 1, 1)
    _write_run(tier, 0, "run-b")
    record = tier.try_commit("j", 1, 2, run_id="run-b")
    assert record is not None and tier.complete_steps("j") == [1]


def test_holdings_follow_a_shard_saved_again(tier):
    from ckpt_core.format import digest

    first = _write(tier, 0, b"first copy")
    assert [h.meta_digest for h in tier.holdings("j", 1, node="n")] == [digest(first.to_bytes())]
    second = _write(tier, 0, b"second copy, longer")
    held = tier.holdings("j", 1, node="n")
    assert [(h.node, h.rank, h.meta_digest) for h in held] == [("n", 0, digest(second.to_bytes()))]
    tier.remove_step("j", 1)
    assert tier.holdings("j", 1) == []


def test_a_failed_removal_is_counted_retried_and_never_blocks_the_step_number(tier, monkeypatch, caplog):
    real_rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    for _ in range(2):  # the same step number, saved and removed twice while its disk refuses to let go
        _write(tier, 0, b"abc", world_size=1)
        tier.try_commit("j", 1, 1)
        monkeypatch.setattr(shutil, "rmtree", refuse)
        tier.remove_step("j", 1)
        monkeypatch.setattr(shutil, "rmtree", real_rmtree)
        assert tier.complete_steps("j") == [] and tier.all_steps("j") == []  # unlisted all the same
    assert tier.removal_failures == 2
    assert "cannot remove" in caplog.text
    left = [p for p in (tier.root / "j").iterdir() if p.name.startswith(".deleting-")]
    assert len(left) == 2  # the disk they still take is visible, not silently leaked
    assert sorted(tier.retry_removals()) == sorted(str(p) for p in left)
    assert list((tier.root / "j").iterdir()) == []


def test_a_block_changed_in_memory_between_its_hashing_and_its_write_fails_the_copy(tmp_path, monkeypatch):
    # A RAM fault in a staging slot while it flushes (the fault campaign's flip-slot): the write reads the
    # block again after it was hashed. The copy must fail, not be sealed with checksums its bytes fail.
    tier = LocalDirTier(tmp_path / "root", write_threads=None)
    payload = os.urandom(2 * CHUNK_SIZE_BYTES)
    data = _buffer(payload)
    opened = tier.open_shard

    def open_shard(meta, transfer=""):
        shard = opened(meta, transfer)
        write = shard.write

        def flipped_then_written(byte_range, block, digests):
            data[7] ^= 0x01  # after chunk_digests read it, before the write does
            write(byte_range, block, digests)

        shard.write = flipped_then_written
        return shard

    monkeypatch.setattr(tier, "open_shard", open_shard)
    with pytest.raises(ShardWriteError, match="checksum mismatch"):
        tier.write_shard(_meta(rank=0, world_size=1, size=len(payload)), data)
    assert not tier.has_shard("j", 1, 0) and tier.all_steps("j") == []
