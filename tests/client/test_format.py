"""Names, validation and sealed records of the on-disk format."""

from __future__ import annotations

import json

import ckpt_core.format as format_module
import pytest
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.format import CommitRecord, ShardMeta, seal, unseal, validate_job, validate_rank, validate_step


@pytest.mark.parametrize("job", ["a", "llama-7b", "run_1.2", "A" * 128])
def test_valid_job_names(job):
    assert validate_job(job) == job


@pytest.mark.parametrize("job", ["", "../x", "a/b", ".hidden", "-x", "A" * 129, "x" * 200, "naïve", None, 3])
def test_invalid_job_names(job):
    with pytest.raises(InvalidArgument, match="invalid job name"):
        validate_job(job)


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, 2**62])
def test_invalid_steps(step):
    with pytest.raises(InvalidArgument, match="invalid step"):
        validate_step(step)


@pytest.mark.parametrize("rank, world_size", [(-1, 2), (2, 2), (0, 0), ("0", 1)])
def test_invalid_ranks(rank, world_size):
    with pytest.raises(InvalidArgument):
        validate_rank(rank, world_size)


def test_sealed_record_detects_any_changed_value():
    data = seal({"world_size": 4, "step": 10})
    assert unseal(data, "x") == {"world_size": 4, "step": 10}
    with pytest.raises(CorruptCheckpoint, match="record checksum mismatch"):
        unseal(data.replace(b'"world_size": 4', b'"world_size": 5'), "x")
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        unseal(data[:-3], "x")


def test_shard_meta_round_trip_and_chunk_coverage():
    meta = ShardMeta("j", 3, 1, 2, 10 << 20, 4 << 20, ("a" * 32, "b" * 32, "c" * 32), '{"tensors": []}')
    assert ShardMeta.from_bytes(meta.to_bytes(), "m") == meta
    short = ShardMeta("j", 3, 1, 2, 10 << 20, 4 << 20, ("a" * 32,), '{"tensors": []}')
    with pytest.raises(CorruptCheckpoint, match="do not cover"):
        ShardMeta.from_bytes(short.to_bytes(), "m")


def test_commit_record_must_list_every_rank():
    rec = CommitRecord("j", 3, 2, ("a" * 32, "b" * 32), 100)
    assert CommitRecord.from_bytes(rec.to_bytes(), "c") == rec
    with pytest.raises(CorruptCheckpoint, match="every rank"):
        CommitRecord.from_bytes(CommitRecord("j", 3, 2, ("a" * 32,), 100).to_bytes(), "c")


def test_a_hostile_shard_record_is_refused_before_anything_is_sized_from_it():
    # Before the bounds, 2**40 one-byte chunks were counted one by one: a hang, then no memory.
    base = {"format": "ckpt-shard", "version": 1, "job": "j", "step": 1, "rank": 0, "world_size": 1}
    for sizes in ({"data_size_bytes": 1 << 40, "chunk_size_bytes": 1}, {"data_size_bytes": 10, "chunk_size_bytes": 0}):
        record = seal({**base, **sizes, "chunk_xxh3_128": [], "layout_json": "{}"})
        with pytest.raises(CorruptCheckpoint, match=r"sizes out of range|do not cover"):
            ShardMeta.from_bytes(record, "from a peer")


def test_a_shard_record_of_an_older_version_keeps_its_bytes_and_compact_ones_check_as_they_lie():
    meta = ShardMeta("j", 3, 1, 2, 10 << 20, 4 << 20, ("a" * 32, "b" * 32, "c" * 32), '{"tensors": []}')
    compact = meta.to_bytes()
    assert compact.startswith(b'{"record":') and unseal(compact, "m")["job"] == "j"
    indented = seal(unseal(compact, "m"))  # as version 1 daemons wrote every record
    assert indented != compact
    read = ShardMeta.from_bytes(indented, "m")
    assert read == meta and read.to_bytes() == indented  # commit records hold the digest of these very bytes
    tampered = compact.replace(b'"step":3', b'"step":4')
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        unseal(tampered, "m")


def test_a_long_layout_is_escaped_in_pieces_into_exactly_the_canonical_body(monkeypatch):
    monkeypatch.setattr(format_module, "LARGE_TEXT_CHARS", 7)  # pieces end inside escapes and wide characters
    layout = json.dumps({"tensors": [{"key": f'w"{i}\\é😀\n', "shape": [i, 2]} for i in range(50)]})
    meta = ShardMeta("j", 3, 1, 2, 10 << 20, 4 << 20, ("a" * 32,) * 3, layout, run_id='"layout_json":""')
    sealed = meta.to_bytes()
    record = unseal(sealed, "m")
    assert record["layout_json"] == layout and record["run_id"] == '"layout_json":""'
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    assert sealed == b'{"record":' + canonical + sealed[len(canonical) + 10 :]  # the body is the canonical one
    assert ShardMeta.from_bytes(sealed, "m") == meta


def test_a_record_nested_deeper_than_python_recurses_is_unreadable_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    body = f'{{"a":{deep}}}'.encode()
    as_sealed = b'{"record":' + body + b',"xxh3_128":"' + format_module.digest(body).encode() + b'"}\n'
    for data in (as_sealed, deep.encode(), b'{"record":' + b"[" * 100_000):  # compact, and older forms
        with pytest.raises(CorruptCheckpoint, match="unreadable record"):
            unseal(data, "from a peer")


@pytest.mark.parametrize(
    "lie",
    [
        {"world_size": 0, "shard_meta_xxh3_128": []},
        {"world_size": "1"},
        {"world_size": 1.5},
        {"world_size": True},
        {"world_size": 3, "shard_meta_xxh3_128": "abc"},
        {"shard_meta_xxh3_128": [7]},
        {"size_bytes": -1},
        {"size_bytes": 2**64},  # once adopted from a peer, every List of the job failed: no int64 holds it
        {"size_bytes": "100"},
    ],
)
def test_a_commit_record_that_checks_but_lies_is_refused(lie):
    record = {"format": "ckpt-commit", "version": 2, "job": "j", "step": 3, "world_size": 1}
    record |= {"shard_meta_xxh3_128": ["a" * 32], "size_bytes": 100, **lie}
    with pytest.raises(CorruptCheckpoint):
        CommitRecord.from_bytes(seal(record), "from a peer")


def test_an_error_quotes_a_megabyte_name_briefly_and_still_says_the_rule():
    with pytest.raises(InvalidArgument) as error:
        validate_job("a" * (3 << 20))
    assert len(str(error.value)) < 300 and "use 1 to 128 characters" in str(error.value)
