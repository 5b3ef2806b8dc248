"""Assemble the replicas other nodes send, range by range, into this node's replica store.

The sender splits a shard into byte ranges and sends each on a data connection of
its own (rpc.data_listener) or, where none is offered, a PutShard stream; every
range is checked chunk by chunk before it is written. SealShard comes once every
range is in: the file is fsynced and installed with the tier's atomic protocol.
receive_range and seal run on the event loop; a data connection is read on a
receiving thread, and checks and writes run on the receiver's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import re
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ckpt.chunks import check_chunks
from ckpt.errors import CorruptCheckpoint, InvalidArgument
from ckpt.format import DIRECT_IO_ALIGN_BYTES, CommitRecord, ShardMeta, chunk_ranges, round_up, shown

from ckptd.errors import AlreadyHeld, ReceiverBusy
from ckptd.storage.durable_write import RangeWriter
from ckptd.tiers.nvme import LocalDirTier

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOCK_BYTES = 8 << 20
MAX_CHUNK_BYTES = 64 << 20
IDLE_TRANSFER_S = 60.0
SPARE_BUFFERS = 16
MAX_TRANSFERS = 32
MAX_RANGES_IN_FLIGHT = 16  # each holds two blocks of buffers (16 MiB): bounds what peers can make this node hold
TRANSFER_RE = re.compile(r"[0-9a-f]{8,64}")


@dataclass
class _Transfer:
    meta: ShardMeta
    partial: Path
    writer: RangeWriter
    chunks_written: set[int] = field(default_factory=set)
    touched_s: float = field(default_factory=time.monotonic)
    ranges_open: int = 0  # ranges being received: the files stay open until the last one ends
    abandoned: bool = False

    def close(self) -> None:
        self.writer.close()

    def abandon(self) -> None:
        """Give the transfer up: its file goes once no range is writing to it."""
        self.abandoned = True
        if self.ranges_open == 0:
            self.close()
            self.partial.unlink(missing_ok=True)


class ReplicaReceiver:
    """Receive replicas into a LocalDirTier."""

    def __init__(self, tier: LocalDirTier, threads: ThreadPoolExecutor) -> None:
        self.tier = tier
        self._threads = threads
        self._transfers: dict[str, _Transfer] = {}
        self._ranges_in_flight = 0
        self._spare_buffers: list[mmap.mmap] = []  # reused: fresh ones would fault in every page per range
        self._recv_threads = ThreadPoolExecutor(MAX_RANGES_IN_FLIGHT, thread_name_prefix="replica-recv")

    async def receive_range(
        self,
        meta: ShardMeta,
        transfer: str,
        offset: int,
        length: int,
        source: AsyncIterator[memoryview] | socket.socket,
    ) -> None:
        """Write one checked range of a replica (CorruptCheckpoint: a bad chunk).

        source is the range's bytes: PutShard's pieces, or a data connection (rpc.data_channel)
        that a receiving thread reads straight into the block buffers.
        """
        self.admit_range(meta, transfer, offset, length)
        self._ranges_in_flight += 1
        try:
            await self._receive(meta, transfer, offset, length, source)
        finally:
            self._ranges_in_flight -= 1

    def admit_range(self, meta: ShardMeta, transfer: str, offset: int, length: int) -> None:
        """Raise InvalidArgument for a range that does not fit its shard, ReceiverBusy when too many are under way."""
        self._check(meta, transfer, offset, length)
        if self._ranges_in_flight >= MAX_RANGES_IN_FLIGHT:
            raise ReceiverBusy(f"{self._what(meta)}: {self._ranges_in_flight} ranges are being received already")

    async def _receive(
        self,
        meta: ShardMeta,
        transfer: str,
        offset: int,
        length: int,
        source: AsyncIterator[memoryview] | socket.socket,
    ) -> None:
        if await _finished(self._threads.submit(self.tier.holds, meta)):
            raise AlreadyHeld(f"{self._what(meta)}: held already")
        t = await self._open(meta, transfer)
        t.ranges_open += 1
        block_bytes = max(1, BLOCK_BYTES // meta.chunk_size_bytes) * meta.chunk_size_bytes
        buffers = [self._buffer(round_up(block_bytes, DIRECT_IO_ALIGN_BYTES)) for _ in range(2)]
        try:
            if isinstance(source, socket.socket):
                work = self._recv_threads.submit(self._recv_range, t, source, buffers, block_bytes, offset, length)
                end = await _finished(work)
            else:
                end = await self._copy_pieces(t, source, buffers, block_bytes, offset, length)
            if end != offset + length:
                raise CorruptCheckpoint(f"{self._what(meta)}: range ended after {end - offset} of {length} bytes")
        except BaseException:
            if self._transfers.get(transfer) is t:  # not a later transfer of the same name
                del self._transfers[transfer]
            t.abandoned = True
            raise
        finally:
            t.ranges_open -= 1
            t.touched_s = time.monotonic()  # idle from now, not from the last piece
            if t.abandoned:
                t.abandon()
            self._spare_buffers = (self._spare_buffers + buffers)[-SPARE_BUFFERS:]

    async def _copy_pieces(
        self,
        t: _Transfer,
        pieces: AsyncIterator[memoryview],
        buffers: list[mmap.mmap],
        block_bytes: int,
        offset: int,
        length: int,
    ) -> int:
        """Copy PutShard's pieces into the block buffers on the event loop; write each full one on a thread.

        Return where the received bytes end."""
        writes: list[Future[None] | None] = [None, None]
        which, filled, base, end = 0, 0, offset, offset + length
        try:
            async for data in pieces:
                view = memoryview(data)
                if base + filled + len(view) > end:
                    raise CorruptCheckpoint(f"{self._what(t.meta)}: more bytes than the range's {length}")
                while view:
                    take = min(len(view), block_bytes - filled)
                    buffers[which][filled : filled + take] = view[:take]
                    filled, view = filled + take, view[take:]
                    if filled == block_bytes:
                        writes[which] = self._threads.submit(self._write, t, buffers[which], base, filled)
                        base, filled, which = base + filled, 0, which ^ 1
                        pending = writes[which]
                        if pending is not None:  # the other buffer's write must finish before it is refilled
                            await _finished(pending)
                            writes[which] = None
                t.touched_s = time.monotonic()
            if filled:
                writes[which] = self._threads.submit(self._write, t, buffers[which], base, filled)
                base += filled
            for i, w in enumerate(writes):
                if w is not None:
                    writes[i] = None
                    await _finished(w)
            return base
        finally:
            # Never close the file or reuse a buffer under a write still running on a thread,
            # even when the sender went away and this handler was cancelled.
            for w in writes:
                if w is not None:
                    with contextlib.suppress(BaseException):
                        await _finished(w)

    def _recv_range(
        self, t: _Transfer, sock: socket.socket, buffers: list[mmap.mmap], block_bytes: int, offset: int, length: int
    ) -> int:
        """On a receiving thread: recv_into the block buffers straight from a data connection, writing each on a thread.

        Return where the received bytes end: short of the range when the sender closed early."""
        writes: list[Future[None] | None] = [None, None]
        which, base, end = 0, offset, offset + length
        try:
            while base < end:
                want, filled = min(block_bytes, end - base), 0
                with memoryview(buffers[which]) as view:
                    while filled < want:
                        received = sock.recv_into(view[filled:want])
                        if not received:
                            return base + filled
                        filled += received
                t.touched_s = time.monotonic()
                writes[which] = self._threads.submit(self._write, t, buffers[which], base, filled)
                base, which = base + filled, which ^ 1
                pending, writes[which] = writes[which], None
                if pending is not None:  # the other buffer's write must finish before it is refilled
                    pending.result()
            for i, w in enumerate(writes):
                writes[i] = None
                if w is not None:
                    w.result()
            return base
        finally:
            for w in writes:  # an error: still no buffer reused, no file closed, under a write
                if w is not None:
                    with contextlib.suppress(BaseException):
                        w.result()

    def _buffer(self, size_bytes: int) -> mmap.mmap:
        while self._spare_buffers:
            buffer = self._spare_buffers.pop()
            if len(buffer) == size_bytes:
                return buffer
        return mmap.mmap(-1, size_bytes)

    async def seal(self, meta: ShardMeta, transfer: str, record: CommitRecord | None) -> None:
        """Make a fully received replica durable and count it; adopt the step's commit record if given."""
        t = self._transfers.pop(transfer, None)
        if t is None or t.meta != meta or t.ranges_open:
            if t is not None:
                t.abandon()
            raise InvalidArgument(f"{self._what(meta)}: no complete transfer {shown(transfer)} of it is here")
        missing = len(list(chunk_ranges(meta.data_size_bytes, meta.chunk_size_bytes))) - len(t.chunks_written)
        try:
            if missing:
                raise InvalidArgument(f"{self._what(meta)}: {missing} chunks never arrived")
            await _finished(self._threads.submit(self._install, t, record))
        except BaseException:
            t.abandon()
            raise

    def _install(self, t: _Transfer, record: CommitRecord | None) -> None:
        t.writer.finish(t.meta.data_size_bytes)
        t.close()
        self.tier.install_shard(t.meta, t.partial, self._what(t.meta))
        if record is not None and (record.job, record.step) == (t.meta.job, t.meta.step):
            self.tier.adopt_commit(record)
        log.info("received the %s", self._what(t.meta))

    def _check(self, meta: ShardMeta, transfer: str, offset: int, length: int) -> None:
        chunk = meta.chunk_size_bytes
        if not TRANSFER_RE.fullmatch(transfer):
            raise InvalidArgument(f"invalid transfer name {shown(transfer)}")
        if not (0 < chunk <= MAX_CHUNK_BYTES and chunk % DIRECT_IO_ALIGN_BYTES == 0):
            raise InvalidArgument(f"{self._what(meta)}: chunk size {chunk} is not a multiple of 4 KiB up to 64 MiB")
        end = offset + length
        if offset < 0 or length < 0 or offset % chunk or end > meta.data_size_bytes:
            raise InvalidArgument(f"{self._what(meta)}: bad range {offset}+{length}")
        if end % chunk and end != meta.data_size_bytes:
            raise InvalidArgument(f"{self._what(meta)}: range {offset}+{length} does not end on a chunk")

    async def _open(self, meta: ShardMeta, transfer: str) -> _Transfer:
        self.drop_idle()
        t = self._transfers.get(transfer)
        if t is not None:
            if t.meta != meta:
                raise InvalidArgument(f"transfer {transfer} carries two different shards")
            return t
        if len(self._transfers) >= MAX_TRANSFERS:  # bounds the memory and descriptors peers can take
            raise ReceiverBusy(f"{self._what(meta)}: {len(self._transfers)} replicas are being received already")
        partial = self.tier.partial_path(meta, transfer[:16])

        def prepare() -> RangeWriter | None:
            self.tier.prepare_shard(meta, self._what(meta))
            if transfer in self._transfers:
                return None
            return RangeWriter(partial, truncate=False, size_bytes=meta.data_size_bytes)

        writer = await _finished(self._threads.submit(prepare))
        t = self._transfers.get(transfer)  # another range of it may have opened it meanwhile
        if t is None:
            assert writer is not None
            t = self._transfers[transfer] = _Transfer(meta, partial, writer)
        elif writer is not None:
            writer.close()
        return t

    def _write(self, t: _Transfer, buffer: mmap.mmap, offset: int, length: int) -> None:
        view = memoryview(buffer)
        try:
            check_chunks(t.meta, view[:length], offset, self._what(t.meta))
            t.writer.write_range(view, offset, length)
            chunk = t.meta.chunk_size_bytes
            t.chunks_written.update(range(offset // chunk, (offset + length + chunk - 1) // chunk))
        finally:
            view.release()

    def _abandon(self, transfer: str) -> None:
        t = self._transfers.pop(transfer, None)
        if t is not None:
            t.abandon()

    def known_meta(self, transfer: str, raw: bytes) -> ShardMeta | None:
        """Return the shard record of a transfer under way if raw is its very bytes (no need to parse them again)."""
        t = self._transfers.get(transfer)
        return t.meta if t is not None and t.meta.to_bytes() == raw else None

    def drop_idle(self) -> None:
        """Drop transfers whose sender went quiet (died, or never sealed): their files and slots go."""
        now = time.monotonic()
        for transfer, t in list(self._transfers.items()):
            if now - t.touched_s > IDLE_TRANSFER_S and not t.ranges_open:
                log.warning("dropping the unfinished replica of %s: its sender went quiet", self._what(t.meta))
                self._abandon(transfer)

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the (job, step) of every replica being received: retention keeps off them."""
        return {(t.meta.job, t.meta.step) for t in self._transfers.values()}

    def close(self) -> None:
        """Drop every unfinished transfer."""
        for transfer in list(self._transfers):
            self._abandon(transfer)
        self._recv_threads.shutdown(wait=False)

    def _what(self, meta: ShardMeta) -> str:
        return f"replica of rank {meta.rank} shard of {meta.job} step {meta.step} on tier {self.tier.name}"


async def _finished(work: Future[T]) -> T:
    """Await work on a thread; if this task is cancelled meanwhile, still wait for the work to end first."""
    wrapped = asyncio.wrap_future(work)
    try:
        return await asyncio.shield(wrapped)
    except asyncio.CancelledError:
        while not wrapped.done():
            with contextlib.suppress(asyncio.CancelledError):  # cancelled again: still wait
                await asyncio.wait([wrapped])
        raise
