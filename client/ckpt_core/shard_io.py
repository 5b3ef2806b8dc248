"""Read one rank's shard from a tier into memory, checking every chunk.

No torch here: the client loads through this module and the daemon's restore and
verify use it too. A shard lives either in a step directory (any tier's layout)
or in a shared-memory staging slot (the memory tier).
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckpt_core.byte_range import WHOLE, ByteRequest
from ckpt_core.chunks import find_bad_chunk
from ckpt_core.commit_keys import CommitKeys
from ckpt_core.errors import CorruptCheckpoint, NotFound
from ckpt_core.format import (
    COMMIT_NAME,
    DIRECT_IO_ALIGN_BYTES,
    INDEX_NAME,
    CommitRecord,
    ShardMeta,
    chunk_ranges,
    data_name,
    digest,
    meta_name,
)

log = logging.getLogger("ckpt")

READ_BLOCK_BYTES = 64 << 20
READ_THREADS = 4


@dataclass(frozen=True)
class ShardSource:
    """Say where a shard of a job's step can be read: a step directory or a staging slot, on a tier."""

    tier: str
    kind: str  # "dir" or "slot"
    path: str
    job: str
    step: int

    def data_path(self, rank: int) -> Path:
        """Return the file holding the shard's tensor bytes."""
        return Path(self.path) / data_name(rank) if self.kind == "dir" else Path(self.path)

    def meta_path(self, rank: int) -> Path:
        """Return the file holding the shard's sealed metadata."""
        return Path(self.path) / meta_name(rank) if self.kind == "dir" else Path(self.path + ".meta.json")


def read_commit(step_dir: Path) -> CommitRecord:
    """Read a step directory's commit record; raise NotFound if the step is not complete.

    With env CKPTD_KEY_FILE set, the record must be signed with that key (ckpt_core.commit_keys):
    how load_local and ckpt.dcp.Reader(path=) check a directory with no daemon to ask.
    """
    path = step_dir / COMMIT_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NotFound(f"{step_dir} holds no complete step (no {COMMIT_NAME})") from None
    return CommitRecord.from_bytes(data, str(path), CommitKeys.from_env())


def read_index(step_dir: Path, record: CommitRecord) -> bytes | None:
    """Return a step directory's sealed index if it has one that belongs to record and checks, else None.

    The index is derived from the shard records: with none (or a stale or damaged one),
    a reader builds it from them (ckpt_core.step_index.index_bytes).
    """
    from ckpt_core.step_index import StepIndex  # the index module builds on this one's records

    path = step_dir / INDEX_NAME
    try:
        data = path.read_bytes()
        StepIndex.from_bytes(data, str(path)).check(record, str(path))
    except FileNotFoundError:
        return None
    except (CorruptCheckpoint, OSError) as e:  # left by another run of the step, or damaged: built again
        log.warning("ckpt: %s; the index is built from the shard records instead", e)
        return None
    return data


def read_meta(source: ShardSource, rank: int) -> ShardMeta:
    """Read and check a shard's metadata: it must be the source's job, step and rank, and match the commit."""
    path = source.meta_path(rank)
    what = f"rank {rank} shard metadata of {source.job} step {source.step} on tier {source.tier} ({path})"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NotFound(f"{what}: missing") from None
    meta = ShardMeta.from_bytes(data, what)
    if source.kind == "slot" and (meta.job, meta.step) != (source.job, source.step):
        # The slot was reused for a newer snapshot since the daemon pointed at it.
        raise NotFound(f"{what}: the slot now holds {meta.job} step {meta.step}")
    if source.kind == "dir":
        commit = read_commit(Path(source.path))
        if (commit.job, commit.step) != (source.job, source.step) or (meta.job, meta.step) != (source.job, source.step):
            raise CorruptCheckpoint(
                f"{what}: holds {meta.job} step {meta.step}, committed as {commit.job} step {commit.step}"
            )
        if meta.rank >= commit.world_size or commit.shard_meta_xxh3_128[meta.rank] != digest(data):
            raise CorruptCheckpoint(f"{what}: does not match the step's commit record")
    if meta.rank != rank:
        raise CorruptCheckpoint(f"{what}: holds rank {meta.rank}")
    return meta


def step_dir_source(step_dir: Path, tier: str) -> ShardSource:
    """Return the source for a step directory whose job and step its commit record names."""
    commit = read_commit(step_dir)
    return ShardSource(tier, "dir", str(step_dir), commit.job, commit.step)


def read_shard_into(source: ShardSource, meta: ShardMeta, buffer: memoryview, wanted: ByteRequest = WHOLE) -> None:
    """Fill buffer with the bytes of the shard that wanted names (a ByteRange, or a ToEnd), each chunk checked.

    The range starts on a chunk boundary; buffer holds the range from its first byte
    and must be writable and hold at least its length rounded up to 4 KiB; where it is
    4 KiB aligned the read uses direct I/O. Raises CorruptCheckpoint naming the shard,
    the tier and the first bad chunk.
    """
    path = source.data_path(meta.rank)
    what = f"rank {meta.rank} shard of {meta.job} step {meta.step} on tier {source.tier} ({path})"
    offset, length = (byte_range := wanted.resolve(meta.data_size_bytes)).offset, byte_range.length
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise NotFound(f"{what}: data file missing") from None
    if size < meta.data_size_bytes or (source.kind == "dir" and size != meta.data_size_bytes):
        raise CorruptCheckpoint(f"{what}: {size} bytes on disk, expected {meta.data_size_bytes}")
    direct_fd = open_direct(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        block_bytes = max(1, READ_BLOCK_BYTES // meta.chunk_size_bytes) * meta.chunk_size_bytes
        blocks = [(offset + o, n) for o, n in chunk_ranges(length, block_bytes)]
        with ThreadPoolExecutor(max_workers=min(READ_THREADS, max(1, len(blocks)))) as pool:
            for bad in pool.map(lambda b: _read_block(direct_fd, fd, meta, buffer, offset, *b), blocks):
                if bad is not None and source.kind == "slot" and not _still_holds(source, meta):
                    raise NotFound(f"{what}: the slot was reused for a newer snapshot while being read")
                if bad is not None:
                    raise CorruptCheckpoint(f"{what}: {bad}")
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)


def _still_holds(source: ShardSource, meta: ShardMeta) -> bool:
    try:
        return ShardMeta.from_bytes(source.meta_path(meta.rank).read_bytes(), "slot") == meta
    except (OSError, CorruptCheckpoint):
        return False


def pread_into(direct_fd: int | None, fd: int, view: memoryview, file_offset: int, length: int) -> int:
    """Fill view[:length] from the file at file_offset; return how many bytes came (fewer at end of file).

    Reads use direct_fd while the memory and sizes allow (view may run past length, up
    to the next 4 KiB, for that), else fd, through the page cache.
    """
    done = 0
    while done < length:
        n = -1
        if direct_fd is not None:
            try:
                n = os.preadv(direct_fd, [view[done:]], file_offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct_fd = None  # this memory or length is not aligned: read through the page cache
        if n < 0:
            n = os.preadv(fd, [view[done:length]], file_offset + done)
        if n == 0:
            break
        done += n
    return min(done, length)


def open_direct(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None  # the filesystem does not do direct I/O


def _read_block(
    direct_fd: int | None, fd: int, meta: ShardMeta, buffer: memoryview, base: int, offset: int, length: int
) -> str | None:
    """Read one block (buffer[0] is byte base of the data) and check its chunks; describe a bad chunk, or None."""
    at = offset - base
    want = min(-(-length // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES, len(buffer) - at)
    done = pread_into(direct_fd, fd, buffer[at : at + want], offset, length)
    if done < length:
        return f"short read at byte {offset + done}"
    return find_bad_chunk(meta, buffer[at : at + length], offset)
