"""A byte range of a shard: the one small type every layer passes for "these bytes", frozen.

Two forms, as zarr v3's RangeByteRequest and OffsetByteRequest: ByteRange (offset and length)
and ToEnd (from an offset to the end of the shard's data). A reader takes either (a
ByteRequest) and resolves it against the shard's size with resolve(). The wire carries the
pair of ckpt.wire.v1's ByteRange; the RPC edges translate one into the other. Ranges the
daemon cuts from a shard start on a chunk boundary (see ckpt_core.format).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteRange:
    """Bytes [offset, offset + length) of a shard's data."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        """Return the offset just past the range."""
        return self.offset + self.length

    def __str__(self) -> str:
        return f"{self.offset}+{self.length}"

    @classmethod
    def whole(cls, size_bytes: int) -> ByteRange:
        """Return the range of a whole shard of size_bytes."""
        return cls(0, size_bytes)

    def resolve(self, size_bytes: int) -> ByteRange:
        """Return the range itself (a reader checks that it fits the shard)."""
        return self


@dataclass(frozen=True)
class ToEnd:
    """Bytes from offset to the end of a shard's data, however long it is."""

    offset: int = 0

    def resolve(self, size_bytes: int) -> ByteRange:
        """Return the range this request names in data of size_bytes."""
        return ByteRange(self.offset, size_bytes - self.offset)

    def __str__(self) -> str:
        return f"{self.offset}+"


ByteRequest = ByteRange | ToEnd  # what a reader takes: a range, or everything from an offset on
WHOLE = ToEnd(0)  # a whole shard
