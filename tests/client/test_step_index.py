"""The step index merges the ranks' chunk tables, and refuses tables that do not cover each tensor exactly once."""

from __future__ import annotations

import json

import pytest
from ckpt.range_read import runs_for
from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import CommitRecord, ShardMeta, digest, seal, unseal
from ckpt_core.step_index import SavedChunk, SavedTensor, StepIndex, index_bytes, is_sharded

MiB = 1 << 20


def meta(rank: int, chunks: list[tuple[str, list[int], list[int]]], shape=(8, 4), world_size: int = 2) -> ShardMeta:
    """Return a rank's record holding the given chunks (key, offsets, lengths) of float32 tensors of shape."""
    tensors, offset = [], 0
    for key, offsets, lengths in chunks:
        nbytes = 4 * lengths[0] * lengths[1]
        tensors.append({"kind": "chunk", "key": key, "dtype": "float32", "shape": lengths, "offsets": offsets,
                        "offset": offset, "nbytes": nbytes})  # fmt: skip
        offset += nbytes
    keys = {k for k, _, _ in chunks} | {"w"}
    dtensors = {k: {"shape": list(shape), "dtype": "float32", "placements": ["Shard(dim=0)"]} for k in keys}
    layout = json.dumps({"tensors": tensors, "skeleton_pickle_b64": "", "dtensors": dtensors})
    return ShardMeta("j", 3, rank, world_size, offset, MiB, ("0" * 32,) * (-(-offset // MiB)), layout)


def record_of(metas: list[ShardMeta]) -> CommitRecord:
    return CommitRecord("j", 3, len(metas), tuple(digest(m.to_bytes()) for m in metas), 0)


def test_the_chunks_of_every_rank_merge_into_one_index_that_round_trips():
    metas = [meta(0, [("w", [0, 0], [5, 4])]), meta(1, [("w", [5, 0], [3, 4])])]
    record = record_of(metas)
    index = StepIndex.build(record, metas)
    assert [(c.rank, c.offsets, c.lengths) for c in index.tensors["w"].chunks] == [
        (0, (0, 0), (5, 4)),
        (1, (5, 0), (3, 4)),
    ]
    again = StepIndex.from_bytes(index.to_bytes(), "index")
    assert again == index
    again.check(record, "index")
    other = CommitRecord("j", 3, 2, ("a" * 32, "b" * 32), 0)
    with pytest.raises(CorruptCheckpoint, match="does not match the step's commit record"):
        again.check(other, "index")


def test_a_chunk_written_twice_counts_once_and_a_gap_or_an_overlap_is_refused():
    twice = [meta(0, [("w", [0, 0], [8, 4])]), meta(1, [("w", [0, 0], [8, 4])])]
    assert len(StepIndex.build(record_of(twice), twice).tensors["w"].chunks) == 1

    gap = [meta(0, [("w", [0, 0], [4, 4])]), meta(1, [("w", [5, 0], [3, 4])])]
    with pytest.raises(CorruptCheckpoint, match=r"'w' hold 28 elements of 32"):
        StepIndex.build(record_of(gap), gap)
    outside = [meta(0, [("w", [0, 0], [5, 4])]), meta(1, [("w", [5, 0], [4, 4])])]
    with pytest.raises(CorruptCheckpoint, match="outside its shape"):
        StepIndex.build(record_of(outside), outside)


def test_ranks_that_disagree_on_a_shape_are_named():
    metas = [meta(0, [("w", [0, 0], [8, 4])]), meta(1, [], shape=(9, 4))]
    with pytest.raises(CorruptCheckpoint, match=r"rank 1 saved 'w' as \(\(9, 4\)"):
        StepIndex.build(record_of(metas), metas)


def test_a_step_of_plain_tensors_has_no_index():
    plain = ShardMeta("j", 3, 0, 1, 0, MiB, (), json.dumps({"tensors": [], "skeleton_pickle_b64": ""}))
    assert not is_sharded(plain)
    assert index_bytes(record_of([plain]), lambda rank: plain) is None


def test_records_of_format_version_1_stay_readable_and_newer_ones_are_refused():
    current = meta(0, [("w", [0, 0], [8, 4])], world_size=1)
    body = unseal(current.to_bytes(), "x")
    assert body["version"] == 2
    old = ShardMeta.from_bytes(seal({**body, "version": 1}), "v1 record")
    assert old.layout_json == current.layout_json
    commit = unseal(record_of([current]).to_bytes(), "c")
    assert CommitRecord.from_bytes(seal({**commit, "version": 1}), "v1 commit").world_size == 1
    with pytest.raises(CorruptCheckpoint, match="version"):
        ShardMeta.from_bytes(seal({**body, "version": 3}), "v3 record")


def test_ranges_widen_to_whole_checksum_chunks_and_merge():
    chunk = 4 * MiB

    def spans(*pairs: tuple[int, int]) -> list[ByteRange]:  # [start, end) pairs, as the tests read best
        return [ByteRange(a, b - a) for a, b in pairs]

    assert runs_for(spans((10, 20), (chunk - 1, chunk + 1), (9 * chunk, 9 * chunk + 5)), chunk, 50 * MiB + 7) == spans(
        (0, 2 * chunk),
        (9 * chunk, 10 * chunk),
    )
    assert runs_for(spans((50 * MiB, 50 * MiB + 7)), chunk, 50 * MiB + 7) == spans((48 * MiB, 50 * MiB + 7))
    assert runs_for(spans((5, 5)), chunk, 100) == []  # an empty range reads nothing


def test_chunks_that_overlap_are_refused_even_when_their_sizes_add_up():
    index = StepIndex("j", 3, 2, ("a" * 32, "b" * 32), {})
    overlapping = (SavedChunk(0, 0, 16, (0,), (4,)), SavedChunk(1, 0, 16, (2,), (4,)))  # rows 6-7 never saved
    bad = StepIndex(
        index.job, index.step, 2, index.shard_meta_xxh3_128, {"w": SavedTensor("w", (8,), "float32", overlapping)}
    )
    with pytest.raises(CorruptCheckpoint, match=r"chunks of 'w' at \[0\] and \[2\] overlap"):
        bad.check_coverage()
    grid = tuple(SavedChunk(r, 0, 16, (i, j), (2, 2)) for r, (i, j) in enumerate([(0, 0), (0, 2), (2, 0), (2, 2)]))
    StepIndex(
        index.job, index.step, 4, ("c" * 32,) * 4, {"g": SavedTensor("g", (4, 4), "float32", grid)}
    ).check_coverage()


def test_a_sharded_record_is_told_from_its_raw_bytes():
    from ckpt_core.step_index import SHARDED_RECORD_MARK

    sharded = meta(0, [("w", [0, 0], [8, 4])], world_size=1)
    plain = ShardMeta("j", 3, 0, 1, 0, MiB, (), json.dumps({"tensors": [], "skeleton_pickle_b64": "ZHRlbnNvcnM="}))
    assert SHARDED_RECORD_MARK in sharded.to_bytes() and is_sharded(sharded)
    assert SHARDED_RECORD_MARK not in plain.to_bytes() and not is_sharded(plain)
