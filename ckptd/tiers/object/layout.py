"""Lay out a shard's bytes as objects: the names, the parts sent, the frames packed, the ranges fetched.

A rank's data is stored whole (`rank-NNNNN.data`) or compressed, one zstd frame per
checksum chunk (`rank-NNNNN.data.zst`), beside a sealed frame index
(`rank-NNNNN.frames.json`) that lists each frame's compressed size. Uploads are cut
into parts of part_bytes; fetches into ranges of range_bytes, whole frames each.
The object tier calls these: compress_frames on the uploading thread that writes its
ShardWrite (one range at a time), unpack_range on its read threads (one fetched range
each), the rest on any thread. Nothing here touches the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import zstandard
from ckpt_core.byte_range import ByteRange
from ckpt_core.chunks import find_bad_chunk
from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import ShardMeta, chunk_ranges, data_name, seal, unseal

PART_BYTES = 16 << 20  # the size of each part sent (a multiple of the 4 MiB chunk)
MAX_PARTS = 9000  # S3 takes at most 10,000 parts per object
READ_THREADS = 8
# A fetch splits a shard into one range per thread, within these bounds: fewer, larger
# GETs cost less per byte (some stores read a whole object to serve a range), and the
# ceiling bounds the memory a fetch holds in flight to READ_THREADS ranges.
MIN_RANGE_BYTES = 16 << 20
MAX_RANGE_BYTES = 64 << 20
ZSTD_LEVEL = 1
COMPRESS_THREADS = 2
FRAME_INDEX_FORMAT = "ckpt-zstd-frames"

# One stored range: (stored offset, stored length, frames), a frame being (data offset, data size, stored size).
Piece = tuple[int, int, list[tuple[int, int, int]]]


def zstd_name(rank: int) -> str:
    """Name the object that holds a rank's compressed data: one zstd frame per checksum chunk."""
    return f"{data_name(rank)}.zst"


def frames_name(rank: int) -> str:
    """Name the sealed record that lists the compressed size of each frame of a rank's data."""
    return f"rank-{rank:05d}.frames.json"


def frame_index(frame_sizes: list[int]) -> bytes:
    """Return the sealed frame index of a compressed shard, written once its data is."""
    return seal({"format": FRAME_INDEX_FORMAT, "version": 1, "frame_sizes": frame_sizes})


def checked_frame_sizes(raw: bytes, meta: ShardMeta, what: str) -> list[int]:
    """Return the frame sizes a sealed frame index lists, once they fit the shard's record."""
    record = unseal(raw, f"{what}, {frames_name(meta.rank)}")
    sizes = record.get("frame_sizes")
    if (
        record.get("format") != FRAME_INDEX_FORMAT
        or not isinstance(sizes, list)
        or len(sizes) != len(meta.chunk_xxh3_128)
        or not all(isinstance(n, int) and 0 < n <= 2 * meta.chunk_size_bytes + 1024 for n in sizes)
    ):
        raise CorruptCheckpoint(f"{what}: its frame index does not fit its shard record")
    return sizes


def compress_frames(compressor: zstandard.ZstdCompressor, meta: ShardMeta, data: memoryview) -> tuple[bytes, list[int]]:
    """Compress whole checksum chunks of a shard (the last may end with it), one zstd frame each.

    Return the frames back to back, and the size of each.
    """
    chunks: list[bytes | bytearray | memoryview] = [
        data[o : o + n] for o, n in chunk_ranges(len(data), meta.chunk_size_bytes)
    ]
    if not chunks:
        return b"", []
    # Each segment is one frame, readable through the buffer protocol (which zstandard's stubs leave out).
    frames: Any = compressor.multi_compress_to_buffer(chunks, threads=COMPRESS_THREADS)
    segments = [memoryview(frames[i]) for i in range(len(frames))]
    return b"".join(segments), [len(s) for s in segments]


def part_bytes(meta: ShardMeta) -> int:
    """Return the size of each part sent for a shard: PART_BYTES, or more for a shard of over MAX_PARTS of them."""
    return max(PART_BYTES, -(-meta.data_size_bytes // MAX_PARTS // meta.chunk_size_bytes) * meta.chunk_size_bytes)


def range_bytes(size_bytes: int, multiple: int = 1) -> int:
    """Return the size of each ranged GET for an object of size_bytes: one range per thread, within bounds."""
    per_thread = -(-size_bytes // READ_THREADS)
    return max(multiple, -(-min(max(per_thread, MIN_RANGE_BYTES), MAX_RANGE_BYTES) // multiple) * multiple)


def plain_pieces(meta: ShardMeta, byte_range: ByteRange) -> list[Piece]:
    """Return the ranges to fetch of a range of a shard stored whole: each one frame, stored as it is."""
    offset, length = byte_range.offset, byte_range.length
    ranges = chunk_ranges(length, range_bytes(length, meta.chunk_size_bytes))
    return [(offset + o, n, [(offset + o, n, n)]) for o, n in ranges]


def frame_groups(meta: ShardMeta, frame_sizes: list[int], group_bytes: int, byte_range: ByteRange) -> Iterator[Piece]:
    """Yield (stored offset, stored length, frames) ranges of about group_bytes, covering a range of the data.

    A frame is (data offset, data size, stored size); the range starts on a chunk
    boundary, and only the frames holding it are fetched.
    """
    offset, end = byte_range.offset, byte_range.end
    stored = 0
    group: list[tuple[int, int, int]] = []
    group_start = 0
    chunks = chunk_ranges(meta.data_size_bytes, meta.chunk_size_bytes)
    for (at, n), size in zip(chunks, frame_sizes, strict=True):
        if at >= end:
            break
        if at < offset:
            stored += size
            group_start = stored
            continue
        group.append((at, n, size))
        stored += size
        if stored - group_start >= group_bytes:
            yield group_start, stored - group_start, group
            group, group_start = [], stored
    if group:
        yield group_start, stored - group_start, group


def unpack_range(
    meta: ShardMeta,
    blob: bytes,
    frames: list[tuple[int, int, int]],
    buffer: memoryview,
    compressed: bool,
    base: int = 0,
) -> str | None:
    """Place a fetched range's chunks into buffer (whose first byte is byte base of the data), checking each.

    Return what is wrong, or None.
    """
    if len(blob) != sum(stored for _, _, stored in frames):
        return f"short read: {len(blob)} bytes"
    decompressor = zstandard.ZstdDecompressor() if compressed else None
    at = 0
    for offset, length, stored in frames:
        piece = memoryview(blob)[at : at + stored]
        at += stored
        if decompressor is not None:
            try:
                plain = decompressor.decompress(piece, max_output_size=length)
            except zstandard.ZstdError as e:
                return f"the compressed chunk at byte {offset} does not decompress: {e}"
            if len(plain) != length:
                return f"the compressed chunk at byte {offset} holds {len(plain)} bytes, expected {length}"
            buffer[offset - base : offset - base + length] = plain
        else:
            buffer[offset - base : offset - base + length] = piece
        bad = find_bad_chunk(meta, buffer[offset - base : offset - base + length], offset)
        if bad is not None:
            return bad
    return None
