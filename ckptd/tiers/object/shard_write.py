"""Send one copy of one shard into an object store: ranges in order, checked, packed into parts, sealed.

ObjectTier.open_shard makes an ObjectShardWrite once the step's commit state lets the shard in
(and the rank's older record is gone); then, on one uploading thread, write() for each range in
order checks its chunks against the shard's record, compresses them where the tier does (one
zstd frame per chunk) and hands the store parts of layout.part_bytes, several in flight on S3;
seal() finishes the data object, then writes the frame index and the record
(storage.commit_protocol's ObjectStepCommit keeps that order); abandon() leaves nothing behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import zstandard
from ckpt_core.byte_range import ByteRange
from ckpt_core.chunks import first_bad_chunk
from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import ShardMeta

from ckptd.errors import ShardWriteError
from ckptd.storage.commit_protocol import ObjectStepCommit
from ckptd.storage.object_store import ObjectParts
from ckptd.tiers.base import ShardWrite
from ckptd.tiers.object.keys import Directory
from ckptd.tiers.object.layout import ZSTD_LEVEL, compress_frames, frame_index, frames_name, part_bytes


class ObjectShardWrite(ShardWrite):
    """One shard's data object under way in the store, then its frame index (compressed) and its record.

    The calls and their threads are ShardWrite's, with ranges in order from one thread
    (`ordered`); abandon() may come from another thread, and waits for a write under way.
    """

    ordered = True

    def __init__(
        self,
        meta: ShardMeta,
        commit: ObjectStepCommit,
        directory: Directory,
        data: ObjectParts,
        compressed: bool,
        what: str,
        source: str,
        on_spent: Callable[[], None],
    ) -> None:
        """Take over data, the shard's data object opened by ObjectTier.open_shard after commit.begin_shard.

        what names the shard and the tier, source the copy sent (for messages); on_spent is
        called once sealed or abandoned (the tier forgets its listings of directory).
        """
        self.meta = meta
        self.what = what
        self._commit = commit
        self._directory = directory
        self._data = data
        self._source = source
        self._on_spent = on_spent
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL) if compressed else None
        self._frame_sizes: list[int] = []
        self._part_bytes = part_bytes(meta)
        self._pending = bytearray()  # bytes not yet handed to the store: less than a part
        self._next_offset = 0  # ranges come in order: where the next one starts
        self._spent = False
        self._lock = threading.Lock()

    def write(self, byte_range: ByteRange, data: memoryview, digests: Sequence[str] | None = None) -> None:
        """Check the range's chunks against meta (or its digests), pack them and hand full parts to the store."""
        meta = self.meta
        with self._lock:
            self._check_open()
            if (
                byte_range.offset != self._next_offset
                or len(data) != byte_range.length
                or byte_range.end > meta.data_size_bytes
                or (byte_range.length % meta.chunk_size_bytes and byte_range.end != meta.data_size_bytes)
            ):
                raise ShardWriteError(
                    f"{self.what}: range {byte_range} is not the next whole chunks (expected at {self._next_offset})"
                )
            if digests is None:
                bad = first_bad_chunk(meta, data, byte_range.offset)
            else:
                bad = _first_unlike(meta, byte_range, digests)
            if bad is not None:
                raise CorruptCheckpoint(f"{self.what}: chunk {bad} of {self._source} changed before upload")
            last = byte_range.end == meta.data_size_bytes
            if self._compressor is None:
                self._push(data, last)
            else:
                packed, sizes = compress_frames(self._compressor, meta, data)
                self._frame_sizes += sizes
                self._push(packed, last)
            self._next_offset = byte_range.end

    def _push(self, piece: bytes | memoryview, last: bool) -> None:
        """Hand the store whole parts of at least part_bytes (the last one may be short), in order."""
        if not self._pending and (len(piece) >= self._part_bytes or last):
            if len(piece):
                self._data.put(_owned(piece))
            return
        self._pending += piece
        if len(self._pending) >= self._part_bytes or last:
            self._data.put(bytes(self._pending))
            self._pending.clear()

    def seal(self, record: ShardMeta | None = None) -> ShardMeta:
        """Finish the data object, then upload the frame index (compressed) and the record: the shard counts."""
        meta = self.meta
        if record is not None and record != meta:  # opened with its full record: nothing to build
            raise ShardWriteError(f"{self.what}: the record to seal is not the one the shard was opened with")
        with self._lock:
            self._check_open()
            self._spent = True
            try:
                if self._next_offset != meta.data_size_bytes:
                    raise ShardWriteError(
                        f"{self.what}: sealed at byte {self._next_offset} of {meta.data_size_bytes}: not uploaded"
                    )
                self._data.finish()
                beside = [] if self._compressor is None else [(frames_name(meta.rank), frame_index(self._frame_sizes))]
                self._commit.install_shard(meta.rank, self._directory, meta.to_bytes(), beside)
            except BaseException:
                self._data.abort()
                raise
            finally:
                self._on_spent()
        return meta

    def abandon(self) -> None:
        """Abort the data object (its multipart upload, or its temporary); nothing of the shard counts."""
        with self._lock:
            if self._spent:
                return
            self._spent = True
            self._pending.clear()
            try:
                self._data.abort()
            finally:
                self._on_spent()

    def _check_open(self) -> None:
        if self._spent:
            raise ShardWriteError(f"{self.what}: this copy was sealed or abandoned already")


def _first_unlike(meta: ShardMeta, byte_range: ByteRange, digests: Sequence[str]) -> int | None:
    """Return the first chunk of the range whose digest (the caller's, from these bytes) is not the record's."""
    first = byte_range.offset // meta.chunk_size_bytes
    count = -(-byte_range.length // meta.chunk_size_bytes)
    expected = meta.chunk_xxh3_128[first : first + count]
    for i in range(count):
        if i >= len(digests) or i >= len(expected) or digests[i] != expected[i]:
            return first + i
    return None


def _owned(piece: bytes | memoryview) -> bytes:
    """Return piece as bytes the store may keep: parts stay in flight after write() returns.

    A view of memory the caller reuses is copied; bytes are not (they never change), nor is a
    view of a whole bytes object (the uploader's pread).
    """
    if isinstance(piece, bytes):
        return piece
    if isinstance(piece.obj, bytes) and piece.nbytes == len(piece.obj) and piece.contiguous:
        return piece.obj
    return bytes(piece)
