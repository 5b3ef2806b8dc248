"""The bulk pieces are serialized by hand: they must be exactly what protobuf writes and reads."""

from __future__ import annotations

import os

import pytest
from ckpt.wire.v1 import peer_pb2 as pb

from ckptd.rpc.peer_link import data_piece, piece_data


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
