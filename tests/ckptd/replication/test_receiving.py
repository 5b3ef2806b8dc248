"""Replicas arrive range by range; every chunk is checked before it is written, and only a whole one counts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.format import CommitRecord, ShardMeta, chunk_ranges, digest
from ckpt_core.shard_io import read_meta

from ckptd.cluster.shard_stream import PIECE_BYTES, byte_ranges
from ckptd.errors import PeerBusy, StepAlreadyComplete
from ckptd.replication.receiving import MAX_RANGES_IN_FLIGHT, ReplicaReceiver
from ckptd.tiers.replica_store import ReplicaStore

CHUNK = 1 << 20


def make_shard(size: int) -> tuple[ShardMeta, bytes]:
    data = os.urandom(size)
    digests = tuple(digest(data[o : o + n]) for o, n in chunk_ranges(size, CHUNK))
    return ShardMeta("j", 3, 0, 1, size, CHUNK, digests, "{}", "run"), data


async def pieces(data: bytes):
    for o in range(0, len(data), PIECE_BYTES // 3):  # pieces that straddle chunks
        yield data[o : o + PIECE_BYTES // 3]


def run(tmp_path, body):
    tier = ReplicaStore(tmp_path / "peer")
    with ThreadPoolExecutor(4) as threads, ThreadPoolExecutor(4) as receiving:
        receiver = ReplicaReceiver(tier, threads, receiving)
        asyncio.run(body(receiver))
        receiver.close()
    return tier


@contextlib.contextmanager
def connection(data: bytes):
    """Yield the receiving end of a socket pair whose other end sends data from a thread, then closes."""
    theirs, ours = socket.socketpair()
    sender = threading.Thread(target=lambda: (theirs.sendall(data), theirs.close()))
    sender.start()
    try:
        yield ours
    finally:
        ours.close()  # a sender still blocked in sendall gets an error and ends
        sender.join()


def test_ranges_in_any_order_make_one_durable_replica(tmp_path):
    meta, data = make_shard(5 * CHUNK + 12345)
    ranges = byte_ranges(meta, 4)
    assert len(ranges) >= 1 and sum(r.length for r in ranges) == meta.data_size_bytes

    async def body(receiver):
        halves = [(0, 3 * CHUNK), (3 * CHUNK, meta.data_size_bytes - 3 * CHUNK)]
        await asyncio.gather(
            *(
                receiver.receive_range(meta, "ab" * 8, ByteRange(o, n), pieces(data[o : o + n]))
                for o, n in reversed(halves)
            )
        )
        await receiver.seal(meta, "ab" * 8)

    tier = run(tmp_path, body)
    step_dir = tier.root / "j" / "3"
    assert (step_dir / "rank-00000.data").read_bytes() == data
    assert read_meta_ok(step_dir, meta)
    assert not list(step_dir.glob("*.partial"))


def test_ranges_read_from_data_connections_make_one_durable_replica(tmp_path):
    meta, data = make_shard(19 * CHUNK + 4321)  # more than two 8 MiB blocks per range, and a short last chunk
    halves = [(0, 10 * CHUNK), (10 * CHUNK, meta.data_size_bytes - 10 * CHUNK)]

    async def body(receiver):
        with connection(data[: 10 * CHUNK]) as first, connection(data[10 * CHUNK :]) as second:
            await asyncio.gather(
                *(
                    receiver.receive_range(meta, "ab" * 8, ByteRange(o, n), sock)
                    for (o, n), sock in zip(halves, (first, second), strict=True)
                )
            )
        await receiver.seal(meta, "ab" * 8)

    tier = run(tmp_path, body)
    assert ((tier.root / "j" / "3") / "rank-00000.data").read_bytes() == data
    assert read_meta_ok((tier.root / "j" / "3"), meta)


@pytest.mark.parametrize("fault", ["bad chunk", "closed early"])
def test_a_data_connection_with_a_bad_chunk_or_cut_short_leaves_nothing(tmp_path, fault):
    meta, data = make_shard(12 * CHUNK)
    sent = bytearray(data)
    if fault == "bad chunk":
        sent[9 * CHUNK + 5] ^= 1  # in the second block: the first is written by then
    else:
        del sent[11 * CHUNK :]
    why = r"chunk 9 .* checksum mismatch" if fault == "bad chunk" else f"range ended after {11 * CHUNK} of"

    async def body(receiver):
        with connection(bytes(sent)) as sock, pytest.raises(CorruptCheckpoint, match=why):
            await receiver.receive_range(meta, "cd" * 8, ByteRange(0, len(data)), sock)
        with pytest.raises(InvalidArgument):
            await receiver.seal(meta, "cd" * 8)

    tier = run(tmp_path, body)
    assert not tier.has_shard("j", 3, 0)
    assert not list((tier.root / "j" / "3").glob("*"))


def read_meta_ok(step_dir, meta) -> bool:
    return ShardMeta.from_bytes((step_dir / "rank-00000.meta.json").read_bytes(), "test") == meta


def test_a_bad_chunk_is_rejected_and_leaves_nothing(tmp_path):
    meta, data = make_shard(3 * CHUNK)
    bad = bytearray(data)
    bad[CHUNK + 7] ^= 1

    async def body(receiver):
        with pytest.raises(CorruptCheckpoint, match=r"chunk 1 .* checksum mismatch"):
            await receiver.receive_range(meta, "cd" * 8, ByteRange(0, len(bad)), pieces(bytes(bad)))
        with pytest.raises(InvalidArgument):
            await receiver.seal(meta, "cd" * 8)

    tier = run(tmp_path, body)
    assert not tier.has_shard("j", 3, 0)
    assert not list((tier.root / "j" / "3").glob("*"))


def test_another_replica_of_a_step_complete_here_is_refused_as_such(tmp_path):
    meta, data = make_shard(CHUNK)
    other, other_data = make_shard(CHUNK)  # other bytes for the same rank of the same step
    record = CommitRecord("j", 3, 1, (digest(meta.to_bytes()),), CHUNK)

    async def body(receiver):
        await receiver.receive_range(meta, "ab" * 8, ByteRange(0, CHUNK), pieces(data))
        await receiver.seal(meta, "ab" * 8)
        receiver.tier.adopt_commit(record)  # the save path adopts the sender's record (SavePath.replica_arrived)
        with pytest.raises(StepAlreadyComplete, match="never rewritten"):  # a refusal, not an internal error
            await receiver.receive_range(other, "cd" * 8, ByteRange(0, CHUNK), pieces(other_data))

    tier = run(tmp_path, body)
    assert tier.checked_commit("j", 3) == record and read_meta_ok((tier.root / "j" / "3"), meta)


def test_a_replica_missing_a_range_is_never_sealed(tmp_path):
    meta, data = make_shard(4 * CHUNK)

    async def body(receiver):
        await receiver.receive_range(meta, "ef" * 8, ByteRange(0, 2 * CHUNK), pieces(data[: 2 * CHUNK]))
        with pytest.raises(InvalidArgument, match="2 chunks never arrived"):
            await receiver.seal(meta, "ef" * 8)

    tier = run(tmp_path, body)
    assert not tier.has_shard("j", 3, 0)


@pytest.mark.parametrize(
    ("transfer", "offset", "length", "why"),
    [
        ("../x", 0, CHUNK, "invalid transfer"),
        ("ab" * 8, 5, CHUNK, "bad range"),
        ("ab" * 8, 0, 8 * CHUNK, "bad range"),
        ("ab" * 8, 0, CHUNK + 1, "does not end on a chunk"),
    ],
)
def test_bad_ranges_are_refused(tmp_path, transfer, offset, length, why):
    meta, data = make_shard(4 * CHUNK)

    async def body(receiver):
        with pytest.raises(InvalidArgument, match=why):
            await receiver.receive_range(meta, transfer, ByteRange(offset, length), pieces(data))

    run(tmp_path, body)


def test_too_many_bytes_in_a_range_are_refused(tmp_path):
    meta, data = make_shard(2 * CHUNK)

    async def body(receiver):
        with pytest.raises(CorruptCheckpoint, match="more bytes"):
            await receiver.receive_range(meta, "ab" * 8, ByteRange(0, CHUNK), pieces(data))

    run(tmp_path, body)


def test_read_meta_of_a_received_step_needs_its_commit(tmp_path):
    meta, data = make_shard(CHUNK)

    async def body(receiver):
        await receiver.receive_range(meta, "ab" * 8, ByteRange(0, CHUNK), pieces(data))
        await receiver.seal(meta, "ab" * 8)

    tier = run(tmp_path, body)
    assert tier.try_commit("j", 3, 1) is not None
    assert read_meta(tier.shard_source("j", 3, 0), 0) == meta


def test_too_many_replicas_at_once_are_refused_until_some_end(tmp_path, monkeypatch):
    import ckptd.replication.receiving

    monkeypatch.setattr(ckptd.replication.receiving, "MAX_TRANSFERS", 1)
    meta, data = make_shard(2 * CHUNK)
    other = ShardMeta(**{**meta.__dict__, "rank": 0, "step": 4})

    async def body(receiver):
        await receiver.receive_range(
            meta, "ab" * 8, ByteRange(0, CHUNK), pieces(data[:CHUNK])
        )  # stays open: no seal yet
        with pytest.raises(PeerBusy):
            await receiver.receive_range(other, "cd" * 8, ByteRange(0, CHUNK), pieces(data[:CHUNK]))
        await receiver.receive_range(meta, "ab" * 8, ByteRange(CHUNK, CHUNK), pieces(data[CHUNK:]))
        await receiver.seal(meta, "ab" * 8)
        await receiver.receive_range(other, "cd" * 8, ByteRange(0, CHUNK), pieces(data[:CHUNK]))

    run(tmp_path, body)


def test_ranges_received_at_once_are_bounded(tmp_path):
    meta, data = make_shard(CHUNK)
    release = asyncio.Event()

    async def held_open():
        await release.wait()
        yield data

    async def body(receiver):
        ranges = [
            asyncio.ensure_future(receiver.receive_range(meta, f"{i:016x}", ByteRange(0, CHUNK), held_open()))
            for i in range(MAX_RANGES_IN_FLIGHT)
        ]
        while receiver._ranges_in_flight < MAX_RANGES_IN_FLIGHT:
            await asyncio.sleep(0)  # let each range start (no time passes: the loop runs the others)
        with pytest.raises(PeerBusy, match="ranges are being received"):
            await receiver.receive_range(meta, "ff" * 8, ByteRange(0, CHUNK), pieces(data))
        release.set()
        await asyncio.gather(*ranges, return_exceptions=True)
        assert receiver._ranges_in_flight == 0

    run(tmp_path, body)


@pytest.mark.parametrize("transport", ["data connection", "PutShard pieces"])
def test_both_transports_go_through_the_one_receive_loop(tmp_path, monkeypatch, transport):
    meta, data = make_shard(19 * CHUNK + 4321)  # more than two 8 MiB blocks, and a short last chunk
    small = ShardMeta("j", 4, 0, 1, 2 * 4096, 4096, (digest(b"\1" * 4096),) * 2, "{}", "run")
    sources = []
    fill_and_write = ReplicaReceiver._fill_and_write

    def spy(self, t, recv_into, *args):
        sources.append(type(getattr(recv_into, "__self__", None)).__name__)
        return fill_and_write(self, t, recv_into, *args)

    monkeypatch.setattr(ReplicaReceiver, "_fill_and_write", spy)

    @contextlib.contextmanager
    def source(sent: bytes):
        if transport == "PutShard pieces":
            yield pieces(sent)
            return
        theirs, ours = socket.socketpair()
        try:
            theirs.sendall(sent)  # small enough to be queued whole: the over-long bytes come with the last
            theirs.close()
            yield ours
        finally:
            ours.close()

    async def body(receiver):
        with connection(data) if transport == "data connection" else contextlib.nullcontext(pieces(data)) as whole:
            await receiver.receive_range(meta, "ab" * 8, ByteRange.whole(len(data)), whole)
        await receiver.seal(meta, "ab" * 8)
        with source(b"\1" * (2 * 4096 + 100)) as too_long, pytest.raises(CorruptCheckpoint, match="more bytes"):
            await receiver.receive_range(small, "cd" * 8, ByteRange.whole(2 * 4096), too_long)

    tier = run(tmp_path, body)
    assert ((tier.root / "j" / "3") / "rank-00000.data").read_bytes() == data
    assert read_meta_ok((tier.root / "j" / "3"), meta)
    assert not tier.has_shard("j", 4, 0) and not list(tier.root.rglob("*.partial"))
    assert sources == ["socket" if transport == "data connection" else "_Pieces"] * 2


def test_a_cancelled_putshard_range_ends_its_thread_and_leaves_nothing(tmp_path):
    meta, data = make_shard(2 * CHUNK)
    stalled = asyncio.Event()

    async def first_piece_then_nothing():
        yield data[:CHUNK]
        stalled.set()
        await asyncio.Event().wait()  # the sender went quiet: only a cancel ends this
        yield data[CHUNK:]

    async def body(receiver):
        stream = first_piece_then_nothing()
        task = asyncio.ensure_future(receiver.receive_range(meta, "ab" * 8, ByteRange(0, 2 * CHUNK), stream))
        await stalled.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()  # no piece is being taken any more: the stream closes
        assert receiver._ranges_in_flight == 0 and receiver.busy_steps() == set()

    tier = run(tmp_path, body)
    assert not tier.has_shard("j", 3, 0) and not list(tier.root.rglob("*.partial"))
