"""Check shard bytes against their per-chunk xxh3-128 checksums: the one chunk verifier.

Every path that reads or copies shard bytes checks them here: the NVMe flush and
the replica receiver before they write, the peer sender and the uploader as they
read, restore, verify and every load. No torch here; any thread may call it.
"""

from __future__ import annotations

from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import ShardMeta, chunk_ranges, digest


def chunk_digests(data: memoryview, chunk_size_bytes: int) -> list[str]:
    """Return the checksum of each chunk of data, which starts on a chunk boundary of its shard."""
    return [digest(data[start : start + n]) for start, n in chunk_ranges(len(data), chunk_size_bytes)]


def first_bad_chunk(meta: ShardMeta, data: memoryview, offset: int) -> int | None:
    """Return the index of the first chunk of data (the shard's bytes from offset on) that does not match meta.

    offset is a multiple of the chunk size; data ends on a chunk boundary or at the end of the shard.
    """
    chunk = meta.chunk_size_bytes
    first = offset // chunk
    for i, (start, n) in enumerate(chunk_ranges(len(data), chunk)):
        if first + i >= len(meta.chunk_xxh3_128) or digest(data[start : start + n]) != meta.chunk_xxh3_128[first + i]:
            return first + i
    return None


def find_bad_chunk(meta: ShardMeta, data: memoryview, offset: int) -> str | None:
    """Describe the first chunk of data that does not match meta (see first_bad_chunk), or return None."""
    index = first_bad_chunk(meta, data, offset)
    return None if index is None else mismatch(meta, index)


def check_chunks(meta: ShardMeta, data: memoryview, offset: int, what: str) -> None:
    """Raise CorruptCheckpoint naming what and the first bad chunk of data (see find_bad_chunk), if any."""
    bad = find_bad_chunk(meta, data, offset)
    if bad is not None:
        raise CorruptCheckpoint(f"{what}: {bad}")


def mismatch(meta: ShardMeta, index: int) -> str:
    """Describe a chunk whose bytes do not match its checksum, as every error about one says it."""
    lo = index * meta.chunk_size_bytes
    hi = min(lo + meta.chunk_size_bytes, meta.data_size_bytes) - 1
    return f"chunk {index} (bytes {lo}-{hi}) checksum mismatch"
