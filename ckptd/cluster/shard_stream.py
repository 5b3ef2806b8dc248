"""Cut a shard into byte ranges and pieces for the wire, checking every chunk on the way out and in."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from ckpt.chunks import check_chunks
from ckpt.errors import CorruptCheckpoint
from ckpt.format import DIRECT_IO_ALIGN_BYTES, ShardMeta, round_up
from ckpt.shard_io import open_direct, pread_into

from ckptd.byte_range import ByteRange

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
    with open(path, "rb", buffering=0) as f, _Reader(f.fileno(), path, round_up(chunk, DIRECT_IO_ALIGN_BYTES)) as read:
        for lo in range(byte_range.offset, byte_range.end, chunk):
            n = min(chunk, byte_range.end - lo)
            data = read(lo, n)
            check_chunks(meta, data, lo, what)
            for p in range(0, n, PIECE_BYTES):
                yield data[p : p + PIECE_BYTES]


class _Reader:
    """Read byte ranges of a file into one page-aligned buffer, with direct I/O when the file allows it."""

    def __init__(self, fd: int, path: Path, size_bytes: int) -> None:
        self._fd = fd
        self._path = path
        self._direct = open_direct(path)
        self._buffer = mmap.mmap(-1, size_bytes)
        self._view = memoryview(self._buffer)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):  # a caller may still hold a slice; then GC unmaps it
            self._buffer.close()
        if self._direct is not None:
            os.close(self._direct)

    def __call__(self, offset: int, length: int) -> memoryview:
        view = self._view[: round_up(length, DIRECT_IO_ALIGN_BYTES)]
        if pread_into(self._direct, self._fd, view, offset, length) < length:
            raise CorruptCheckpoint(f"{self._path}: short read in bytes {offset}-{offset + length - 1}")
        return self._view[:length]


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
