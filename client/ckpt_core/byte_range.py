"""A byte range of a shard: the one small type every layer passes for "these bytes", frozen.

The wire carries the same pair as ckpt.wire.v1's ByteRange; the RPC edges translate one into
the other. Ranges the daemon cuts from a shard start on a chunk boundary (see ckpt_core.format).
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
