"""Slot mappings are reused across saves, and never outlive the file they map."""

from __future__ import annotations

import os

from ckpt.staging import SlotMappings


def test_mapping_is_reused_while_the_file_is_the_same(tmp_path):
    path = tmp_path / "slot"
    path.write_bytes(b"\0" * 8192)
    maps = SlotMappings()
    a = maps.get(str(path), 8192)
    assert maps.get(str(path), 8192) is a


def test_a_replaced_file_is_mapped_again(tmp_path):
    path = tmp_path / "slot"
    path.write_bytes(b"\0" * 8192)
    maps = SlotMappings()
    old = maps.get(str(path), 8192)
    os.unlink(path)  # the daemon dropped the slot and later made a new one of the same name and size
    path.write_bytes(b"\0" * 8192)
    new = maps.get(str(path), 8192)
    new[0] = 7
    assert path.read_bytes()[0] == 7
    assert old is not new
