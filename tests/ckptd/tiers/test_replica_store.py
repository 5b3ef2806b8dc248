"""The replica store and the restore target: their own small things, each made of a directory tier."""

from __future__ import annotations

import mmap
import os

import pytest
from ckpt_core.errors import CheckpointError
from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta, data_name, digest, round_up

from ckptd.tiers.replica_store import ReplicaStore
from ckptd.tiers.restore_target import DestinationUnwritable, RestoreTarget


def _buffer(payload: bytes) -> memoryview:
    m = mmap.mmap(-1, round_up(max(len(payload), 1), 4096))
    m[: len(payload)] = payload
    return memoryview(m)


def _meta(rank: int, size: int, world_size: int = 2) -> ShardMeta:
    return ShardMeta("j", 3, rank, world_size, size, CHUNK_SIZE_BYTES, (), '{"tensors": []}')


def test_a_replica_is_retired_only_as_the_copy_named_and_the_step_goes_with_its_last(tmp_path):
    store = ReplicaStore(tmp_path / ".peer")
    assert store.name == "peer"
    metas = [store.write_shard(_meta(rank, 100), _buffer(os.urandom(100))) for rank in (0, 1)]
    assert not store.remove_shard("j", 3, 0, "0" * 32)  # another copy of rank 0: kept
    assert [h.rank for h in store.holdings("j", 3)] == [0, 1]
    assert store.remove_shard("j", 3, 0, digest(metas[0].to_bytes()))
    assert [h.rank for h in store.holdings("j", 3)] == [1] and store.all_steps("j") == [3]
    assert store.remove_shard("j", 3, 1, digest(metas[1].to_bytes()))
    assert store.all_steps("j") == [] and not (tmp_path / ".peer" / "j" / "3").exists()


def test_a_restore_target_holds_a_step_only_once_sealed_and_clears_what_a_failed_one_left(tmp_path):
    target = RestoreTarget(tmp_path / "out")
    target.clear("j", 3)  # nothing there: nothing to do
    target.begin("j", 3)
    target.write(_meta(0, 100, world_size=2), _buffer(os.urandom(100)))
    with pytest.raises(CheckpointError, match="not every shard was written"):
        target.seal("j", 3, 2)
    assert not target.holds_step("j", 3)
    target.clear("j", 3)
    assert not target.step_dir("j", 3).exists()
    target.begin("j", 3)
    target.write(_meta(0, 100, world_size=1), _buffer(os.urandom(100)))
    target.seal("j", 3, 1)
    assert target.holds_step("j", 3) and (target.step_dir("j", 3) / data_name(0)).stat().st_size == 100


def test_a_restore_target_that_cannot_be_written_says_so(tmp_path):
    (tmp_path / "out").write_bytes(b"a file where the destination's directory should be")
    with pytest.raises(DestinationUnwritable, match="cannot write the restore destination"):
        RestoreTarget(tmp_path / "out").begin("j", 3)
