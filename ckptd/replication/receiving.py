"""Assemble the replicas other nodes send, range by range, into this node's replica store.

The sender splits a shard into byte ranges and sends each on a data connection of
its own (rpc.data_listener) or, where none is offered, a PutShard stream. Each transfer
(one copy of one shard) holds one ShardWrite of the tier (ShardSink.open_shard),
opened by its first range: every range goes through the same receive loop, on a
receiving thread, which fills two aligned block buffers by turns from the transport
(a data connection's recv_into, or PutShard's pieces taken from the event loop) and
hands each full one to ShardWrite.write on the receiver's threads, where its chunks
are checked and written. SealShard comes once every range is in: ShardWrite.seal
fsyncs and installs the shard with the tier's atomic protocol. receive_range and seal
run on the event loop.

A range that comes on a data connection is reserved first (reserve_range, from
OpenDataRange): every refusal that needs none of its bytes (a bad range, too many under
way, held already, a step complete here) is made then, as a gRPC status, and the range
keeps its place among those in flight until receive_reserved (the connection) or release
(its ticket unused: the transfer is given up too) gives it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.format import DIRECT_IO_ALIGN_BYTES, ShardMeta, round_up, shown

from ckptd.errors import AlreadyHeld, PeerBusy
from ckptd.log_pace import LogPace
from ckptd.tiers.base import ShardWrite
from ckptd.tiers.replica_store import ReplicaStore

log = logging.getLogger(__name__)

_refusals = LogPace()  # keyed by (job, step): a sender retries a refused replica, rank by rank
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
    shard: ShardWrite
    touched_s: float = field(default_factory=time.monotonic)
    ranges_open: int = 0  # ranges being received: the copy stays until the last one ends
    abandoned: bool = False

    def abandon(self) -> None:
        """Give the transfer up: its copy goes once no range is receiving into it."""
        self.abandoned = True
        if self.ranges_open == 0:
            self.shard.abandon()


@dataclass
class RangeReservation:
    """A range admitted before its bytes come (a data connection's ticket): its place among the ranges in flight."""

    meta: ShardMeta
    transfer: str
    byte_range: ByteRange
    transfer_state: _Transfer
    released: bool = False


class ReplicaReceiver:
    """Receive replicas into the replica store."""

    def __init__(self, tier: ReplicaStore, threads: ThreadPoolExecutor, receive_threads: ThreadPoolExecutor) -> None:
        """threads: checks and writes of received blocks; receive_threads: one per range being received (at most
        MAX_RANGES_IN_FLIGHT), which fills its buffers from the range's transport."""
        self.tier = tier
        self._commit_keys = tier.commit_keys  # replicas' shard records are checked against them before a write
        self._threads = threads
        self._transfers: dict[str, _Transfer] = {}
        self._opening: dict[str, asyncio.Future[None]] = {}  # transfers whose ShardWrite a range is opening
        self._ranges_in_flight = 0
        self._spare_buffers: list[mmap.mmap] = []  # reused: fresh ones would fault in every page per range
        self._recv_threads = receive_threads

    async def receive_range(
        self,
        meta: ShardMeta,
        transfer: str,
        byte_range: ByteRange,
        source: AsyncIterator[memoryview] | socket.socket,
    ) -> None:
        """Write one checked range of a replica (CorruptCheckpoint: a bad chunk, or more bytes than the range).

        source is the range's bytes: PutShard's pieces, or a data connection (cluster.data_channel)
        that a receiving thread reads straight into the block buffers.
        """
        await self.receive_reserved(await self.reserve_range(meta, transfer, byte_range), source)

    async def reserve_range(self, meta: ShardMeta, transfer: str, byte_range: ByteRange) -> RangeReservation:
        """Make every refusal known before a range's bytes come, and hold a place for it (event loop).

        Raises InvalidArgument (the range does not fit its shard, or the transfer carries another
        shard), PeerBusy (too many ranges or replicas under way), AlreadyHeld (this very replica
        is here) and StepAlreadyComplete (the step is complete here with other shards). The place
        is given back by receive_reserved, or by release when the range never comes.
        """
        self.admit_range(meta, transfer, byte_range)
        self._ranges_in_flight += 1
        try:
            if await wait_finished(self._threads.submit(self.tier.holds, meta)):
                raise AlreadyHeld(f"{self._what(meta)}: held already")
            t = await self._open(meta, transfer)
        except BaseException:
            self._ranges_in_flight -= 1
            raise
        return RangeReservation(meta, transfer, byte_range, t)

    def release(self, reservation: RangeReservation) -> None:
        """Give back the place of a reserved range that never came (its ticket expired or was not offered, or the
        listener stopped), and give its transfer up: its sender sends the shard again under another, if at all."""
        if self._give_back(reservation) and self._transfers.get(reservation.transfer) is reservation.transfer_state:
            self._abandon(reservation.transfer)

    def _give_back(self, reservation: RangeReservation) -> bool:
        """Give back a reserved range's place among those in flight; return whether it still held one."""
        if reservation.released:
            return False
        reservation.released = True
        self._ranges_in_flight -= 1
        return True

    async def receive_reserved(
        self, reservation: RangeReservation, source: AsyncIterator[memoryview] | socket.socket
    ) -> None:
        """Receive a range reserve_range admitted, then give its place back (see receive_range)."""
        try:
            t = reservation.transfer_state
            if self._transfers.get(reservation.transfer) is not t or t.abandoned:
                raise InvalidArgument(
                    f"{self._what(reservation.meta)}: transfer {shown(reservation.transfer)} was dropped meanwhile"
                )
            await self._receive(t, reservation.meta, reservation.transfer, reservation.byte_range, source)
        finally:
            self._give_back(reservation)

    def admit_range(self, meta: ShardMeta, transfer: str, byte_range: ByteRange) -> None:
        """Raise InvalidArgument for a range that does not fit its shard, PeerBusy when too many are under way."""
        self._check(meta, transfer, byte_range)
        if self._ranges_in_flight >= MAX_RANGES_IN_FLIGHT:
            raise PeerBusy(f"{self._what(meta)}: {self._ranges_in_flight} ranges are being received already")

    async def _receive(
        self,
        t: _Transfer,
        meta: ShardMeta,
        transfer: str,
        byte_range: ByteRange,
        source: AsyncIterator[memoryview] | socket.socket,
    ) -> None:
        t.ranges_open += 1
        block_bytes = max(1, BLOCK_BYTES // meta.chunk_size_bytes) * meta.chunk_size_bytes
        buffers = [self._buffer(round_up(block_bytes, DIRECT_IO_ALIGN_BYTES)) for _ in range(2)]
        pieces = None
        if isinstance(source, socket.socket):
            recv_into: Callable[[memoryview], int] = source.recv_into
        else:
            pieces = _Pieces(source, asyncio.get_running_loop(), byte_range.length, self._what(meta))
            recv_into = pieces.recv_into
        try:
            try:
                work = self._recv_threads.submit(self._fill_and_write, t, recv_into, buffers, block_bytes, byte_range)
                end = await wait_finished(work, on_cancel=pieces.stop if pieces is not None else None)
            finally:
                if pieces is not None:
                    await pieces.settle()
            if end != byte_range.end:
                received = end - byte_range.offset
                raise CorruptCheckpoint(
                    f"{self._what(meta)}: range ended after {received} of {byte_range.length} bytes"
                )
            if byte_range.length == 0 and not isinstance(source, socket.socket):
                # An empty range reads no piece in the loop: one that comes anyway is refused, as any extra.
                extra: memoryview | None = await anext(source, None)
                if extra:
                    raise CorruptCheckpoint(f"{self._what(meta)}: more bytes than the range's 0")
        except BaseException:
            if self._transfers.get(transfer) is t:  # not a later transfer of the same name
                del self._transfers[transfer]
            t.abandoned = True
            raise
        finally:
            t.ranges_open -= 1
            t.touched_s = time.monotonic()  # idle from now, not from the last block
            if t.abandoned:
                t.abandon()
            self._spare_buffers = (self._spare_buffers + buffers)[-SPARE_BUFFERS:]

    def _fill_and_write(
        self,
        t: _Transfer,
        recv_into: Callable[[memoryview], int],
        buffers: list[mmap.mmap],
        block_bytes: int,
        byte_range: ByteRange,
    ) -> int:
        """On a receiving thread: fill the two block buffers by turns from recv_into, writing each on a thread.

        The one receive loop of both transports. recv_into(view) puts the next bytes into view
        and returns how many, 0 once the sender is done: a data connection's socket.recv_into,
        or _Pieces.recv_into for PutShard's. Each read may fill the rest of a block buffer, so
        bytes past the range that come with its last ones are seen: CorruptCheckpoint. A buffer
        is refilled only once its write has ended, and the loop ends (also on an error) only
        once no write is running. Return where the received bytes end: short of the range
        when the sender stopped early.
        """
        writes: list[Future[None] | None] = [None, None]
        which, base, end = 0, byte_range.offset, byte_range.end
        try:
            while base < end:
                want, filled = min(block_bytes, end - base), 0
                with memoryview(buffers[which]) as view:
                    while filled < want:
                        received = recv_into(view[filled:block_bytes])
                        if not received:
                            break
                        filled += received
                if base + filled > end:
                    raise CorruptCheckpoint(f"{self._what(t.meta)}: more bytes than the range's {byte_range.length}")
                t.touched_s = time.monotonic()
                if filled < want:  # the sender is done, short of the range: that block is not written
                    base += filled
                    break
                writes[which] = self._threads.submit(self._write, t, buffers[which], ByteRange(base, filled))
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
            for w in writes:  # an error: still no buffer reused, no copy abandoned, under a write
                if w is not None:
                    with contextlib.suppress(BaseException):
                        w.result()

    def _buffer(self, size_bytes: int) -> mmap.mmap:
        while self._spare_buffers:
            buffer = self._spare_buffers.pop()
            if len(buffer) == size_bytes:
                return buffer
        return mmap.mmap(-1, size_bytes)

    async def seal(self, meta: ShardMeta, transfer: str) -> None:
        """Make a fully received replica durable and count it (its step's commit record, if the sender gave one,
        is the save path's to adopt: SavePath.replica_arrived).

        InvalidArgument where no such transfer is here whole (a range never arrived, or one is still running).
        """
        t = self._transfers.pop(transfer, None)
        if t is None or t.meta != meta or t.ranges_open:
            if t is not None:
                t.abandon()
            raise InvalidArgument(f"{self._what(meta)}: no complete transfer {shown(transfer)} of it is here")
        try:
            await wait_finished(self._threads.submit(self._install, t))
        except BaseException:
            t.abandon()
            raise

    def _install(self, t: _Transfer) -> None:
        t.shard.seal()
        log.info("received the %s", self._what(t.meta))

    def _check(self, meta: ShardMeta, transfer: str, byte_range: ByteRange) -> None:
        chunk = meta.chunk_size_bytes
        if not TRANSFER_RE.fullmatch(transfer):
            raise InvalidArgument(f"invalid transfer name {shown(transfer)}")
        if not (0 < chunk <= MAX_CHUNK_BYTES and chunk % DIRECT_IO_ALIGN_BYTES == 0):
            raise InvalidArgument(f"{self._what(meta)}: chunk size {chunk} is not a multiple of 4 KiB up to 64 MiB")
        offset, end = byte_range.offset, byte_range.end
        if offset < 0 or byte_range.length < 0 or offset % chunk or end > meta.data_size_bytes:
            raise InvalidArgument(f"{self._what(meta)}: bad range {byte_range}")
        if end % chunk and end != meta.data_size_bytes:
            raise InvalidArgument(f"{self._what(meta)}: range {byte_range} does not end on a chunk")

    async def _open(self, meta: ShardMeta, transfer: str) -> _Transfer:
        """Return the transfer's state, its ShardWrite opened by the first of its ranges (the others wait for it)."""
        self.drop_idle()
        while (opening := self._opening.get(transfer)) is not None:
            await asyncio.wait([opening])
        t = self._transfers.get(transfer)
        if t is not None:
            if t.meta != meta:
                raise InvalidArgument(f"transfer {transfer} carries two different shards")
            return t
        if len(self._transfers) + len(self._opening) >= MAX_TRANSFERS:  # bounds the memory and descriptors peers take
            raise PeerBusy(f"{self._what(meta)}: {len(self._transfers)} replicas are being received already")
        opened = self._opening[transfer] = asyncio.get_running_loop().create_future()
        work = self._threads.submit(self._open_signed, meta, transfer[:16])
        try:
            shard = await wait_finished(work)
            t = self._transfers[transfer] = _Transfer(meta, shard)
            return t
        except BaseException:
            if work.done() and not work.cancelled() and work.exception() is None:  # cancelled once it was open
                work.result().abandon()
            raise
        finally:
            del self._opening[transfer]
            opened.set_result(None)

    def _open_signed(self, meta: ShardMeta, transfer: str) -> ShardWrite:
        """Open the replica's ShardWrite once its shard record checks with the keys (a worker thread).

        A record not signed by one of them (a peer certificate without the key, making up
        a step) is refused as a bad chunk is, CorruptCheckpoint (DATA_LOSS), before anything
        is written; logged once a minute per step.
        """
        try:
            self._commit_keys.check(meta, self._what(meta))
        except CorruptCheckpoint as e:
            if _refusals.due((meta.job, meta.step)):
                log.error("refused a replica: %s", e)
            raise
        return self.tier.open_shard(meta, transfer)

    def _write(self, t: _Transfer, buffer: mmap.mmap, byte_range: ByteRange) -> None:
        with memoryview(buffer) as view:
            t.shard.write(byte_range, view[: byte_range.length])

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

    async def retire(self, job: str, step: int, rank: int, meta_digest: str) -> bool:
        """Drop the replica store's copy of a shard (RetireReplica: this node stood in for its placed node)."""
        if any((job, step) == busy for busy in self.busy_steps()):
            return False  # being received again: the sender's newer copy is not the one to retire
        return bool(await wait_finished(self._threads.submit(self.tier.remove_shard, job, step, rank, meta_digest)))

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the (job, step) of every replica being received: retention keeps off them."""
        return {(t.meta.job, t.meta.step) for t in self._transfers.values()}

    def close(self) -> None:
        """Drop every unfinished transfer."""
        for transfer in list(self._transfers):
            self._abandon(transfer)

    def _what(self, meta: ShardMeta) -> str:
        return f"replica of rank {meta.rank} shard of {meta.job} step {meta.step} on tier {self.tier.name}"


class _Pieces:
    """PutShard's pieces, read into the receive loop's buffers from its receiving thread.

    recv_into (the receiving thread) takes each piece from the async iterator on the event
    loop and copies it on the thread, not on the loop. The range's bytes end where the
    pieces end: a piece past the range's length, or one after its last byte, is
    CorruptCheckpoint. stop() and settle() run on the event loop: stop, once the range's
    handler is cancelled, ends the thread's wait for a piece; settle waits until no piece
    is being taken, so that the iterator can be closed.
    """

    def __init__(self, pieces: AsyncIterator[memoryview], loop: asyncio.AbstractEventLoop, length: int, what: str):
        self._pieces = pieces
        self._loop = loop
        self._length = length
        self._what = what
        self._left = length  # bytes of the range not yet in a piece taken
        self._piece = memoryview(b"")  # the rest of the piece taken last
        self._taking: asyncio.Task[memoryview | None] | None = None  # event loop only, as the two below
        self._taken: Future[memoryview | None] | None = None
        self._stopped = False

    def recv_into(self, view: memoryview) -> int:
        """Copy the next bytes into view; return how many (0: the pieces are over)."""
        if not self._piece:
            piece = self._next()
            if piece is None:
                return 0
            if len(piece) > self._left:
                raise CorruptCheckpoint(f"{self._what}: more bytes than the range's {self._length}")
            self._left -= len(piece)
            self._piece = piece
        n = min(len(view), len(self._piece))
        view[:n] = self._piece[:n]
        self._piece = self._piece[n:]
        if not self._piece and not self._left and self._next() is not None:
            raise CorruptCheckpoint(f"{self._what}: more bytes than the range's {self._length}")
        return n

    def _next(self) -> memoryview | None:
        """Take the next piece that is not empty, or None at the end (receiving thread)."""
        while True:
            taken: Future[memoryview | None] = Future()
            self._loop.call_soon_threadsafe(self._take, taken)
            piece = taken.result()  # CancelledError once stopped
            if piece is None or len(piece):
                return None if piece is None else memoryview(piece)

    def _take(self, taken: Future[memoryview | None]) -> None:
        if self._stopped:
            taken.cancel()
            return
        self._taken = taken
        self._taking = self._loop.create_task(_anext_or_none(self._pieces))
        self._taking.add_done_callback(lambda task: _pass_on(task, taken))

    def stop(self) -> None:
        """Stop taking pieces: a wait for one ends with CancelledError."""
        self._stopped = True
        if self._taking is not None:
            self._taking.cancel()
        if self._taken is not None:
            self._taken.cancel()

    async def settle(self) -> None:
        """Wait until no piece is being taken from the iterator."""
        if self._taking is not None and not self._taking.done():
            await asyncio.wait([self._taking])


async def _anext_or_none(pieces: AsyncIterator[memoryview]) -> memoryview | None:
    return await anext(pieces, None)


def _pass_on(task: asyncio.Task[T], taken: Future[T]) -> None:
    """Give a task's outcome to the thread waiting on taken (event loop); nothing if stop() cancelled it."""
    if taken.cancelled():
        return
    if task.cancelled():
        taken.cancel()
    elif (error := task.exception()) is not None:
        taken.set_exception(error)
    else:
        taken.set_result(task.result())


async def wait_finished(work: Future[T], on_cancel: Callable[[], None] | None = None) -> T:
    """Await work on a thread; if this task is cancelled meanwhile, still wait for the work to end first.

    on_cancel, called on the event loop once this task is cancelled, tells the work to end soon.
    """
    wrapped = asyncio.wrap_future(work)
    try:
        return await asyncio.shield(wrapped)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not wrapped.done():
            with contextlib.suppress(asyncio.CancelledError):  # cancelled again: still wait
                await asyncio.wait([wrapped])
        if not wrapped.cancelled():
            wrapped.exception()  # read: the work's own end (stopped by on_cancel) is not an error to log
        raise
