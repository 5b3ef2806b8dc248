"""Commit and shard record signatures (ckpt_core.commit_keys): what they cover, what they leave to the tier, keys."""

from __future__ import annotations

import dataclasses
import json

import pytest
from ckpt_core.commit_keys import UNSIGNED, CommitKeys, key_id, read_key
from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import CommitRecord, ShardMeta, seal, unseal

KEY, OLD = bytes(range(32)), bytes(range(1, 33))
RECORD = CommitRecord("train", 7, 2, ("a" * 32, "b" * 32), 100, ((0, 7),), "2026-01-01T00:00:00Z")
SHARD = ShardMeta("train", 7, 1, 2, 100, 64, ("a" * 32, "b" * 32), '{"tensors": []}', "run", ((0, 7),), "2026-01-01")


def test_a_signed_record_round_trips_on_every_tier_and_compares_equal_to_itself_unsigned():
    keys = CommitKeys((KEY,))
    signed = keys.sign(RECORD)
    assert signed.key_id == key_id(KEY) and len(signed.hmac_sha256) == 64
    assert signed == RECORD  # two nodes mid-rotation seal the same record
    assert CommitRecord.from_bytes(signed.to_bytes(), "t", keys).hmac_sha256 == signed.hmac_sha256
    record, object_keys = CommitRecord.from_object_bytes(signed.to_bytes(object_keys="flat"), "t", keys)
    assert (record.hmac_sha256, object_keys) == (signed.hmac_sha256, "flat")  # the version is not signed


def test_a_record_without_a_valid_signature_is_refused_with_a_key_and_read_without_one():
    keys = CommitKeys((KEY,))
    with pytest.raises(CorruptCheckpoint, match="is not signed"):
        CommitRecord.from_bytes(RECORD.to_bytes(), "t", keys)
    with pytest.raises(CorruptCheckpoint, match=f"unknown key '{key_id(OLD)}'"):
        CommitRecord.from_bytes(CommitKeys((OLD,)).sign(RECORD).to_bytes(), "t", keys)
    # A field changed and the xxh3 seal recomputed with the project's own code: the HMAC no longer matches.
    body = json.loads(keys.sign(RECORD).to_bytes())["record"]
    body["shard_meta_xxh3_128"][1] = "c" * 32
    with pytest.raises(CorruptCheckpoint, match="signature does not match"):
        CommitRecord.from_bytes(seal(body), "t", keys)
    assert CommitRecord.from_bytes(seal(body), "t", UNSIGNED).shard_meta_xxh3_128[1] == "c" * 32  # off: unchecked
    assert CommitRecord.from_bytes(RECORD.to_bytes(), "t") == RECORD  # older, unsigned records stay readable
    rotated = CommitKeys((KEY, OLD))
    assert CommitRecord.from_bytes(CommitKeys((OLD,)).sign(RECORD).to_bytes(), "t", rotated) == RECORD
    assert rotated.sign(RECORD).key_id == key_id(KEY)  # the first key signs


def test_a_shard_record_is_signed_and_checked_as_a_commit_record_is():
    keys, rotated = CommitKeys((KEY,)), CommitKeys((OLD, KEY))
    signed = keys.sign(SHARD)
    assert signed.key_id == key_id(KEY) and signed == SHARD
    read = ShardMeta.from_bytes(signed.to_bytes(), "t")
    assert keys.check(read, "t") is read and rotated.check(read, "t") is read  # a previous key checks too
    assert read.to_bytes() == signed.to_bytes()  # the bytes a commit record's digest is of
    with pytest.raises(CorruptCheckpoint, match="the shard record is not signed"):
        keys.check(ShardMeta.from_bytes(SHARD.to_bytes(), "t"), "t")
    with pytest.raises(CorruptCheckpoint, match=f"shard record is signed with an unknown key '{key_id(OLD)}'"):
        keys.check(ShardMeta.from_bytes(CommitKeys((OLD,)).sign(SHARD).to_bytes(), "t"), "t")
    # A chunk digest or the layout changed and the xxh3 seal recomputed, as a peer without the key would.
    for field, value in (("chunk_xxh3_128", ["a" * 32, "c" * 32]), ("layout_json", '{"tensors": [1]}')):
        body = unseal(signed.to_bytes(), "t") | {field: value}
        forged = ShardMeta.from_bytes(seal(body, compact=True), "t")
        with pytest.raises(CorruptCheckpoint, match="shard record's signature does not match"):
            keys.check(forged, "t")
        assert UNSIGNED.check(forged, "t") is forged  # signing off: nothing checked


def test_key_files_hex_or_raw_private_and_long_enough(tmp_path):
    hex_file, raw_file = tmp_path / "hex", tmp_path / "raw"
    hex_file.write_text(KEY.hex() + "\n")
    raw_file.write_bytes(b"\xff" + bytes(range(40)))
    for path in (hex_file, raw_file):
        path.chmod(0o640)
    assert read_key(hex_file) == KEY and read_key(raw_file) == b"\xff" + bytes(range(40))
    hex_file.chmod(0o604)
    with pytest.raises(ValueError, match="other users may read it"):
        read_key(hex_file)
    short = tmp_path / "short"
    short.write_text(KEY.hex()[:40])
    short.chmod(0o600)
    with pytest.raises(ValueError, match="holds 20 bytes of key"):
        read_key(short)
    assert repr(KEY) not in repr(CommitKeys((KEY,))) and CommitKeys.from_files("") is UNSIGNED
    assert dataclasses.replace(RECORD, key_id="x") == RECORD
