"""Cut a shard into byte ranges and pieces for the wire, checking every chunk on the way out and in."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from ckpt_core.byte_range import ByteRange
from ckpt_core.chunks import check_chunks
from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import DIRECT_IO_ALIGN_BYTES, ShardMeta, round_up
from ckpt_core.shard_io import open_direct, pread_into

PIECE_BYTES = 1 << 20  # one gRPC message
MIN_RANGE_BYTES = 32 << 20  # smaller shards travel on fewer streams


def byte_ranges(meta: ShardMeta, streams: int) -> list[ByteRange]:
    """Split a shard into up to `streams` ranges on chunk boundaries."""
    chunks = max(1, -(-meta.data_size_bytes // meta.chunk_size_bytes))
    min_chunks = max(1, MIN_RANGE_BYTES // meta.chunk_size_bytes)
    count = max(1, min(streams, chunks // min_chunks))
    per = -(-chunks // count) * meta.chunk_size_bytes
    size = meta.data_size_bytes
    return [ByteRange(lo, min(per, size - lo)) for lo in range(0, size, per)] or [ByteRange(0, 0)]


def read_pieces(path: Path, meta: ShardMeta, byte_range: ByteRange, what: str) -> Iterator[memoryview]:
    """Yield a range of a shard's bytes in pieces, each chunk checked against meta before its pieces are yielded.

    A piece is a view of a reused buffer: copy it before asking for the next one.

    The range starts on a chunk boundary. Reads use direct I/O where the file
    allows it (a shard on NVMe, written with direct I/O, is not in the page cache).
    Raises CorruptCheckpoint naming the chunk when the bytes do not match, which is
    also what a staging slot reused for a newer snapshot looks like.
    """
    chunk = meta.chunk_size_bytes
    with open(path, "rb", buffering=0) as f:
        direct = open_direct(path)
        buffer = mmap.mmap(-1, round_up(chunk, DIRECT_IO_ALIGN_BYTES))
        view = memoryview(buffer)
        try:
            for lo in range(byte_range.offset, byte_range.end, chunk):
                n = min(chunk, byte_range.end - lo)
                if pread_into(direct, f.fileno(), view[: round_up(n, DIRECT_IO_ALIGN_BYTES)], lo, n) < n:
                    raise CorruptCheckpoint(f"{path}: short read in bytes {lo}-{lo + n - 1}")
                check_chunks(meta, view[:n], lo, what)
                for p in range(0, n, PIECE_BYTES):
                    yield view[p : min(p + PIECE_BYTES, n)]
        finally:
            view.release()
            with contextlib.suppress(BufferError):  # a caller may still hold a piece; then GC unmaps it
                buffer.close()
            if direct is not None:
                os.close(direct)


def fill_from_pieces(
    buffer: memoryview, meta: ShardMeta, pieces: Iterable[memoryview], what: str, byte_range: ByteRange
) -> None:
    """Copy a range of a shard arriving in pieces into buffer, checking each chunk as it completes.

    The range starts on a chunk boundary; buffer holds it from its first byte.
    """
    chunk = meta.chunk_size_bytes
    offset, size = byte_range.offset, byte_range.length
    filled = 0
    for piece in pieces:
        view = memoryview(piece)
        if filled + len(view) > size:
            raise CorruptCheckpoint(f"{what}: more bytes than the {size} asked for")
        buffer[filled : filled + len(view)] = view
        checked = filled - filled % chunk  # the chunks before this one were checked as they completed
        filled += len(view)
        whole = filled if filled == size else filled - filled % chunk
        if whole > checked:
            check_chunks(meta, buffer[checked:whole], offset + checked, what)
    if filled != size:
        raise CorruptCheckpoint(f"{what}: {filled} bytes arrived, expected {size}")
