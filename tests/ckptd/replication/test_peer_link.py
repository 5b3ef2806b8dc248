"""The bulk pieces are serialized by hand: they must be exactly what protobuf writes and reads."""

from __future__ import annotations

import os

import pytest
from ckpt_core.wire.v1 import peer_pb2 as pb

from ckptd.cluster.peer_link import data_piece, piece_data


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 1 << 20, (1 << 20) + 3])
def test_pieces_are_protobuf_on_the_wire(size):
    data = os.urandom(size)
    wire = data_piece(memoryview(data))
    assert wire == pb.ShardPiece(data=data).SerializeToString()
    assert pb.ShardPiece.FromString(wire).data == data
    assert bytes(piece_data(wire)) == data


def test_other_shapes_of_a_piece_still_parse():
    wire = pb.ShardPiece(data=b"abc", offset=7).SerializeToString()
    assert bytes(piece_data(wire)) == b"abc"


def test_a_range_arriving_in_pieces_is_checked_against_its_own_chunks():
    from ckpt_core.byte_range import ByteRange
    from ckpt_core.chunks import chunk_digests
    from ckpt_core.errors import CorruptCheckpoint
    from ckpt_core.format import ShardMeta

    from ckptd.cluster.shard_stream import fill_from_pieces

    chunk = 1 << 16
    data = os.urandom(5 * chunk + 7)
    meta = ShardMeta("j", 1, 0, 1, len(data), chunk, tuple(chunk_digests(memoryview(data), chunk)), "{}")
    offset, length = 2 * chunk, 3 * chunk + 7  # the last three chunks, the short one included
    pieces = [memoryview(data)[at : at + 1000] for at in range(offset, offset + length, 1000)]
    buffer = bytearray(length)
    fill_from_pieces(memoryview(buffer), meta, pieces, "range", ByteRange(offset, length))
    assert bytes(buffer) == data[offset:]
    shifted = [memoryview(data)[at : at + 1000] for at in range(chunk, chunk + length, 1000)]  # the wrong bytes
    with pytest.raises(CorruptCheckpoint, match="chunk 2 "):
        fill_from_pieces(memoryview(bytearray(length)), meta, shifted, "range", ByteRange(offset, length))
