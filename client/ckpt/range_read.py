"""Read checked byte ranges of any rank's data of one step: this node's copies first, then the daemon's stream.

A sharded load (ckpt.reshard) calls StepReader.read once per saved rank it needs,
from the loading thread; the reads themselves run on READ_THREADS threads, which
call `consume` for each run once all of its chunks check. A range is widened to
whole checksum chunks (4 MiB) and neighbouring ranges are merged into runs, so
every byte handed on has been checked, and a row range of a large tensor is read
without the rest of it. A copy that fails (a bad chunk, a slot reused meanwhile,
a file gone) is set aside for the next one; the last resort is the daemon, which
fetches the ranges from the peers or the object store. No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from ckpt_core.byte_range import ByteRange
from ckpt_core.chunks import find_bad_chunk
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import DIRECT_IO_ALIGN_BYTES, ShardMeta, digest, round_up
from ckpt_core.shard_io import ShardSource, read_meta, read_shard_into

log = logging.getLogger("ckpt")

READ_THREADS = 4
Consume = Callable[[int, np.ndarray], None]  # (run start, its checked bytes)
# Fetch runs (ByteRanges, chunk-aligned at the start) of a rank's data through the daemon: their bytes in order.
RemoteRead = Callable[[int, list[ByteRange]], Iterator[bytes]]


def fresh_buffer(size_bytes: int) -> np.ndarray:
    """Return new page-aligned memory (direct I/O needs the alignment).

    numpy's allocator asks the kernel for huge pages on large arrays, which makes
    faulting in fresh memory several times cheaper than plain 4 KiB pages.
    """
    raw = np.empty(size_bytes + DIRECT_IO_ALIGN_BYTES, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_IO_ALIGN_BYTES
    return raw[skip : skip + size_bytes]


def runs_for(ranges: Iterable[ByteRange], chunk_size_bytes: int, data_size_bytes: int) -> list[ByteRange]:
    """Widen each range to whole checksum chunks and merge those that touch, in order: the runs to read."""
    runs: list[list[int]] = []
    widened = sorted(
        (r.offset - r.offset % chunk_size_bytes, min(-(-r.end // chunk_size_bytes) * chunk_size_bytes, data_size_bytes))
        for r in ranges
        if r.length > 0
    )
    for start, end in widened:
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    return [ByteRange(a, b - a) for a, b in runs]


class StepReader:
    """Read checked runs of the ranks' data of one step, each rank from the first copy that holds good bytes."""

    def __init__(
        self,
        job: str,
        step: int,
        shard_meta_xxh3_128: tuple[str, ...],
        local: dict[int, list[ShardSource]],
        remote: tuple[Callable[[int], bytes], RemoteRead] | None = None,
    ) -> None:
        self.job, self.step = job, step
        self.digests = shard_meta_xxh3_128
        self.local = local
        self.remote = remote  # (fetch a rank's record, fetch runs of its data), or None with no daemon
        self._metas: dict[int, ShardMeta] = {}

    def meta(self, rank: int) -> ShardMeta:
        """Return a rank's shard record, from a local copy or the daemon, checked against the step's commit."""
        if rank in self._metas:
            return self._metas[rank]
        errors: list[str] = []
        for source in self.local.get(rank, []):
            try:
                meta = read_meta(source, rank)
                self._check_meta(meta, rank, source.tier)
                self._metas[rank] = meta
                return meta
            except (CheckpointError, OSError) as e:
                errors.append(str(e))
        if self.remote is None:
            raise NotFound(f"rank {rank} shard record of {self.job} step {self.step}: " + ("; ".join(errors) or "none"))
        what = f"rank {rank} shard record of {self.job} step {self.step} from the daemon"
        meta = ShardMeta.from_bytes(self.remote[0](rank), what)
        self._check_meta(meta, rank, "daemon")
        self._metas[rank] = meta
        return meta

    def _check_meta(self, meta: ShardMeta, rank: int, where: str) -> None:
        if meta.rank != rank or digest(meta.to_bytes()) != self.digests[rank]:
            raise CorruptCheckpoint(
                f"rank {rank} shard record of {self.job} step {self.step} on {where}: "
                "does not match the step's commit record"
            )

    def read(self, rank: int, ranges: Iterable[ByteRange], consume: Consume) -> None:
        """Read the byte ranges of rank's data, checked, and hand each run to consume (from reading threads)."""
        meta = self.meta(rank)
        todo = runs_for(ranges, meta.chunk_size_bytes, meta.data_size_bytes)
        errors: list[str] = []
        for source in self.local.get(rank, []):
            if not todo:
                return
            try:
                todo = self._read_local(source, meta, todo, consume)
            except _Partial as e:
                todo = e.left
                errors.append(str(e))
                log.warning("ckpt: %s; trying the next copy", e)
            except (CheckpointError, OSError) as e:
                errors.append(str(e))
                log.warning("ckpt: %s; trying the next copy", e)
        if todo and self.remote is not None:
            try:
                self._read_remote(meta, todo, consume)
                return
            except CheckpointError as e:
                errors.append(str(e))
        if todo:
            what = f"rank {rank} shard of {self.job} step {self.step}"
            if any("mismatch" in e for e in errors):
                raise CorruptCheckpoint(f"{what}: no copy holds good bytes: " + "; ".join(errors))
            raise NotFound(f"{what}: no copy could be read: " + ("; ".join(errors) or "none on this node"))

    def _read_local(
        self, source: ShardSource, meta: ShardMeta, runs: list[ByteRange], consume: Consume
    ) -> list[ByteRange]:
        """Read runs from one copy; return the runs left (none), or raise _Partial with those not handed on."""
        if read_meta(source, meta.rank) != meta:
            raise CorruptCheckpoint(f"rank {meta.rank} shard on tier {source.tier}: holds another record")
        done: set[ByteRange] = set()

        def one(run: ByteRange) -> None:
            buffer = fresh_buffer(round_up(run.length, DIRECT_IO_ALIGN_BYTES))
            read_shard_into(source, meta, memoryview(buffer), run)  # type: ignore[arg-type]
            consume(run.offset, buffer[: run.length])
            done.add(run)

        with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(runs))) as pool:
            failures = [f.exception() for f in [pool.submit(one, r) for r in runs]]
        first = next((e for e in failures if e is not None), None)
        if first is None:
            return []
        if isinstance(first, CheckpointError | OSError):
            raise _Partial(first, [r for r in runs if r not in done])
        raise first

    def _read_remote(self, meta: ShardMeta, runs: list[ByteRange], consume: Consume) -> None:
        assert self.remote is not None
        what = f"rank {meta.rank} shard of {meta.job} step {meta.step} from the daemon"
        pieces = self.remote[1](meta.rank, runs)
        pending = memoryview(b"")
        for run in runs:
            start, end = run.offset, run.end
            buffer = fresh_buffer(run.length)
            filled = 0
            while filled < end - start:
                if not pending:
                    pending = memoryview(next(pieces, b""))
                    if not pending:
                        raise CheckpointError(f"{what}: the stream ended at byte {start + filled}")
                n = min(len(pending), end - start - filled)
                buffer[filled : filled + n] = np.frombuffer(pending, dtype=np.uint8, count=n)
                pending = pending[n:]
                filled += n
            bad = find_bad_chunk(meta, memoryview(buffer), start)  # type: ignore[arg-type]
            if bad is not None:
                raise CorruptCheckpoint(f"{what}: {bad}")
            consume(start, buffer)


class _Partial(CheckpointError):
    """A copy failed part way: the runs it did not hand on are still to read."""

    def __init__(self, cause: BaseException, left: list[ByteRange]) -> None:
        super().__init__(str(cause))
        self.left = left
