"""The data channel, both ends: refusals reach the sender as statuses, no connection stops or starves the listener,
and the sender falls back to PutShard only when the channel itself fails.

A real DataListener and ReplicaReceiver on an event loop of their own (a thread), senders on the test's thread.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from ckpt_core.byte_range import ByteRange
from ckpt_core.format import ShardMeta, chunk_ranges, digest
from ckpt_core.wire.v1 import peer_pb2 as pb

from ckptd.cluster import data_channel, shard_stream
from ckptd.cluster.data_channel import DataChannelError, send_range
from ckptd.cluster.peer_link import PeerLink, ReplicaRejected, piece_data
from ckptd.config import PeerConfig
from ckptd.errors import AlreadyHeld, PeerBusy, StepAlreadyComplete
from ckptd.replication.receiving import ReplicaReceiver
from ckptd.rpc import data_listener
from ckptd.rpc.data_listener import MAX_PER_ADDRESS, DataListener
from ckptd.rpc.statuses import status_line, status_of
from ckptd.tiers.replica_store import ReplicaStore

T = TypeVar("T")
CHUNK = 1 << 20
BIG = 32 * CHUNK  # far more than the socket buffers hold: a sender refused early is still sending


def make_shard(tmp_path: Path, size: int, name: str = "shard.data") -> tuple[ShardMeta, Path]:
    data = os.urandom(size)
    digests = tuple(digest(data[o : o + n]) for o, n in chunk_ranges(size, CHUNK))
    path = tmp_path / name
    path.write_bytes(data)
    return ShardMeta("j", 3, 0, 1, size, CHUNK, digests, "{}", "run"), path


class Node:
    """A receiver and its data listener on an event loop of their own, as a daemon runs them."""

    def __init__(self, tmp_path: Path, host: str = "127.0.0.1", before_start: Any = None) -> None:
        self.tier = ReplicaStore(tmp_path / "peer")
        self._pools = [ThreadPoolExecutor(4), ThreadPoolExecutor(16), ThreadPoolExecutor(48)]
        self.receiver = ReplicaReceiver(self.tier, self._pools[0], self._pools[1])
        self.bad_chunks = 0
        self.listener = DataListener(self.receiver, PeerConfig(), host, self._bad_chunk, self._pools[2])
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        if before_start is not None:
            before_start(self.loop)
        self.run(self.listener.start())

    def _bad_chunk(self) -> None:
        self.bad_chunks += 1

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    async def offer(self, meta: ShardMeta, transfer: str, byte_range: ByteRange) -> bytes:
        """What PeerServicer.OpenDataRange does."""
        reservation = await self.receiver.reserve_range(meta, transfer, byte_range)
        try:
            return self.listener.offer(reservation)
        except BaseException:
            self.receiver.release(reservation)
            raise

    def close(self) -> None:
        self.run(self.listener.stop())
        self.receiver.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        for pool in self._pools:
            pool.shutdown()


@pytest.fixture
def node(tmp_path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.close()


def send(node: Node, ticket: bytes, meta: ShardMeta, path: Path, byte_range: ByteRange | None = None) -> str:
    byte_range = byte_range or ByteRange(0, meta.data_size_bytes)
    return send_range("127.0.0.1", node.listener.port, ticket, None, path, meta, byte_range, "test")


def test_a_range_arrives_whole_with_a_ticket(node, tmp_path):
    meta, path = make_shard(tmp_path, 5 * CHUNK + 123)
    ticket = node.run(node.offer(meta, "ab" * 8, ByteRange(0, meta.data_size_bytes)))
    assert send(node, ticket, meta, path) == "OK"
    node.run(node.receiver.seal(meta, "ab" * 8))
    assert ((node.tier.root / "j" / "3") / "rank-00000.data").read_bytes() == path.read_bytes()


def test_a_ticket_never_offered_is_refused_with_a_status_not_a_broken_pipe(node, tmp_path):
    # The sender is still sending 32 MiB when it is refused: it reads the status, not EPIPE or a reset.
    meta, path = make_shard(tmp_path, BIG)
    status = send(node, bytes(16), meta, path)
    assert status.startswith("PERMISSION_DENIED no such data range offered")
    assert not list(node.tier.root.rglob("*.partial"))


def test_a_bad_chunk_refused_part_way_reaches_the_sender_as_data_loss(node, tmp_path):
    meta, path = make_shard(tmp_path, BIG)
    other, _ = make_shard(tmp_path, BIG, "other.data")  # the receiver expects other bytes from the first chunk
    ticket = node.run(node.offer(other, "cd" * 8, ByteRange(0, BIG)))
    status = send(node, ticket, meta, path)
    assert status.startswith("DATA_LOSS") and "chunk 0" in status
    assert node.bad_chunks == 1
    assert not list(node.tier.root.rglob("*.partial"))


def test_what_is_refusable_before_the_bytes_is_refused_by_the_offer(node, tmp_path):
    meta, path = make_shard(tmp_path, 2 * CHUNK)
    ticket = node.run(node.offer(meta, "ab" * 8, ByteRange(0, meta.data_size_bytes)))
    assert send(node, ticket, meta, path) == "OK"
    node.run(node.receiver.seal(meta, "ab" * 8))
    with pytest.raises(AlreadyHeld):  # OpenDataRange answers ALREADY_EXISTS: no connection is opened
        node.run(node.offer(meta, "ef" * 8, ByteRange(0, meta.data_size_bytes)))
    assert node.receiver.busy_steps() == set()
    assert node.run(_in_flight(node)) == 0


async def _in_flight(node: Node) -> int:
    return node.receiver._ranges_in_flight


def test_one_table_maps_errors_to_statuses_on_both_transports():
    # AlreadyHeld came back INTERNAL on a data connection (caught as a CheckpointError first).
    assert status_line(AlreadyHeld("held already")) == "ALREADY_EXISTS held already"
    assert status_line(StepAlreadyComplete("complete")).startswith("FAILED_PRECONDITION")
    assert status_line(PeerBusy("busy")).startswith("RESOURCE_EXHAUSTED")


def test_tickets_are_bounded_and_an_unused_one_gives_its_place_back(node, tmp_path, monkeypatch):
    monkeypatch.setattr(data_listener, "MAX_TICKETS", 3)
    monkeypatch.setattr(data_listener, "TICKET_TTL_S", 0.5)
    meta, path = make_shard(tmp_path, 8 * CHUNK)
    tickets = [node.run(node.offer(meta, "ab" * 8, ByteRange(i * CHUNK, CHUNK))) for i in range(3)]
    with pytest.raises(PeerBusy, match="offered already"):
        node.run(node.offer(meta, "ab" * 8, ByteRange(3 * CHUNK, CHUNK)))
    assert node.run(_in_flight(node)) == 3
    deadline = time.monotonic() + 10
    while node.run(_in_flight(node)):
        assert time.monotonic() < deadline, "unused tickets kept their places"
        time.sleep(0.05)
    assert node.receiver.busy_steps() == set()  # the transfer they opened is given up, its file gone
    assert not list(node.tier.root.rglob("*.partial"))
    assert send(node, tickets[0], meta, path, ByteRange(0, CHUNK)).startswith("PERMISSION_DENIED")


def test_accept_errors_are_survived_and_stop_raises_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(data_channel, "STALL_TIMEOUT_S", 5.0)  # a connection left in the backlog fails fast
    failures = [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ECONNABORTED]

    def inject(loop: asyncio.AbstractEventLoop) -> None:
        real = loop.sock_accept

        async def failing_accept(sock):
            if failures:
                raise OSError(failures.pop(0), "injected")
            return await real(sock)

        loop.sock_accept = failing_accept  # type: ignore[method-assign]

    n = Node(tmp_path, before_start=inject)
    meta, path = make_shard(tmp_path, 2 * CHUNK)
    try:
        ticket = n.run(n.offer(meta, "ab" * 8, ByteRange(0, meta.data_size_bytes)))
        assert send(n, ticket, meta, path) == "OK"
        assert n.listener.counters["accept_failures"] == 4
        assert "accepting a connection failed" in caplog.text
    finally:
        n.close()  # raises nothing


def idle_connection(port: int, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.settimeout(20)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_and_trickling_connections_starve_no_range(node, tmp_path, monkeypatch):
    monkeypatch.setattr(data_listener, "HANDSHAKE_DEADLINE_S", 1.5)
    port = node.listener.port
    # One host opens 40 connections that never send a ticket (the old listener's 32 slots, and more).
    idle = [idle_connection(port, "127.0.0.2") for _ in range(40)]
    trickler = idle_connection(port, "127.0.0.3")
    started = time.monotonic()
    meta, path = make_shard(tmp_path, 4 * CHUNK)
    ticket = node.run(node.offer(meta, "ab" * 8, ByteRange(0, meta.data_size_bytes)))
    assert send(node, ticket, meta, path) == "OK"  # from 127.0.0.1: its slots are its own
    # Beyond its share, the host's connections are closed at once; the rest at the deadline, however slow.
    assert node.listener.counters["connections_refused"] >= 40 - MAX_PER_ADDRESS
    for _ in range(5):
        trickler.sendall(b"x")
        time.sleep(0.3)
    assert all(closed_by_peer(s) for s in [*idle, trickler])
    assert time.monotonic() - started < 10
    for s in [*idle, trickler]:
        s.close()


def test_ranges_past_their_ticket_leave_their_address_share_to_others(node, tmp_path):
    # Two shards of four ranges each from one sender, and a second daemon on the same host: more than
    # MAX_PER_ADDRESS ranges come from one address at once; only connections before their ticket count.
    meta, path = make_shard(tmp_path, 12 * CHUNK)
    held = []
    for i in range(MAX_PER_ADDRESS + 1):
        ticket = node.run(node.offer(meta, "cd" * 8, ByteRange(i * CHUNK, CHUNK)))
        sock = socket.create_connection(("127.0.0.1", node.listener.port), timeout=20)
        sock.sendall(ticket + b"x")  # past its ticket, receiving (slowly)
        held.append(sock)
    deadline = time.monotonic() + 10
    while node.run(_receiving(node)) < len(held):
        assert time.monotonic() < deadline, "the held ranges never began"
        time.sleep(0.05)
    ticket = node.run(node.offer(meta, "ab" * 8, ByteRange(11 * CHUNK, CHUNK)))
    assert send(node, ticket, meta, path, ByteRange(11 * CHUNK, CHUNK)) == "OK"
    assert node.listener.counters["connections_refused"] == 0
    for sock in held:
        sock.close()


async def _receiving(node: Node) -> int:
    return len(node.listener._receiving)


def test_at_stop_offered_tickets_and_ranges_in_flight_get_their_grace(tmp_path):
    n = Node(tmp_path)
    meta, path = make_shard(tmp_path, 4 * CHUNK)
    ticket = n.run(n.offer(meta, "ab" * 8, ByteRange(0, meta.data_size_bytes)))
    stopping = asyncio.run_coroutine_threadsafe(n.listener.stop(), n.loop)
    with pytest.raises(PeerBusy, match="stopping"):  # no ticket is offered once stop began
        n.run(n.offer(meta, "cd" * 8, ByteRange(0, meta.data_size_bytes)))
    assert send(n, ticket, meta, path) == "OK"  # the one offered before is still taken
    stopping.result(30)
    n.run(n.receiver.seal(meta, "ab" * 8))
    n.close()


def test_the_listener_takes_the_family_of_the_listen_host(tmp_path):
    # The data port is on the host of [node] listen, in its family; a sender dials the host it reached gRPC at.
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        n = Node(tmp_path, host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    meta, path = make_shard(tmp_path, 2 * CHUNK)
    try:
        ticket = n.run(n.offer(meta, "ab" * 8, ByteRange(0, meta.data_size_bytes)))
        with pytest.raises(DataChannelError):  # the other family: the channel fails, no status (PutShard then)
            send_range("127.0.0.1", n.listener.port, ticket, None, path, meta, ByteRange(0, 2 * CHUNK), "test")
        assert send_range("::1", n.listener.port, ticket, None, path, meta, ByteRange(0, 2 * CHUNK), "t") == "OK"
    finally:
        n.close()


# -- the sending side: PeerLink, with a stand-in for the peer's servicer in front of the real receiver


class RpcError(grpc.RpcError):
    def __init__(self, code: str, details: str = "") -> None:
        self._code, self._details = grpc.StatusCode[code], details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Peer:
    """OpenDataRange, PutShard and SealShard answered as PeerServicer does, on a Node's receiver and listener."""

    def __init__(self, node: Node, unimplemented: bool = False, expect: ShardMeta | None = None) -> None:
        self.node = node
        self.unimplemented = unimplemented
        self.expect = expect  # the shard record the receiver is told of (default: the one sent)
        self.opened: list[str] = []
        self.streamed: list[str] = []
        self.sealed: list[str] = []

    def _answer(self, work: Coroutine[Any, Any, T]) -> T:
        try:
            return self.node.run(work)
        except Exception as e:
            code, details = status_of(e) or ("INTERNAL", str(e))
            raise RpcError(code, details) from None

    def OpenDataRange(self, request: pb.ShardPiece, timeout: float, metadata: Any) -> pb.DataRangeTicket:
        self.opened.append(request.transfer)
        if self.unimplemented:
            raise RpcError("UNIMPLEMENTED")
        meta = self.expect or ShardMeta.from_bytes(request.meta_json, "test")
        byte_range = ByteRange(request.offset, request.length)
        ticket = self._answer(self.node.offer(meta, request.transfer, byte_range))
        return pb.DataRangeTicket(port=self.node.listener.port, ticket=ticket)

    def put_shard(self, pieces: Iterator[bytes], timeout: float, metadata: Any) -> pb.PutShardReply:
        first = pb.ShardPiece.FromString(next(pieces))
        data = [bytes(piece_data(p)) for p in pieces]
        self.streamed.append(first.transfer)

        async def source():
            for piece in data:
                yield memoryview(piece)

        meta = ShardMeta.from_bytes(first.meta_json, "test")
        byte_range = ByteRange(first.offset, first.length)
        self._answer(self.node.receiver.receive_range(meta, first.transfer, byte_range, source()))
        return pb.PutShardReply()

    def SealShard(self, request: pb.SealShardRequest, timeout: float, metadata: Any) -> pb.SealShardReply:
        meta = ShardMeta.from_bytes(request.meta_json, "test")
        self._answer(self.node.receiver.seal(meta, request.transfer))
        self.sealed.append(request.transfer)
        return pb.SealShardReply()


@pytest.fixture
def link() -> Iterator[PeerLink]:
    link = PeerLink("127.0.0.1:1", PeerConfig())
    link.connect = lambda timeout_s=0.0: None  # type: ignore[method-assign]
    yield link
    link.close()


def talk_to(link: PeerLink, peer: Peer) -> None:
    link._stub = peer  # type: ignore[assignment]
    link._put_shard = peer.put_shard  # type: ignore[assignment]


@pytest.fixture
def streams() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:  # one range at a time, in order
        yield pool


def received(node: Node, path: Path) -> bool:
    return ((node.tier.root / "j" / "3") / "rank-00000.data").read_bytes() == path.read_bytes()


def test_an_older_peer_without_open_data_range_gets_put_shard_and_is_asked_again_after_a_minute(
    node, link, streams, tmp_path
):
    peer = Peer(node, unimplemented=True)
    talk_to(link, peer)
    meta, path = make_shard(tmp_path, 2 * CHUNK)
    link.put_shard(meta, path, streams)
    assert received(node, path) and peer.streamed == peer.sealed == peer.opened
    assert link.ranges_sent == {"data_channel": 0, "grpc_stream": 1}
    other = ShardMeta(**{**meta.__dict__, "step": 4})
    link.put_shard(other, path, streams)
    assert len(peer.opened) == 1, "asked again within DATA_CHANNEL_RETRY_S"
    link._data_channel_off_until = time.monotonic()  # a minute later
    link.put_shard(ShardMeta(**{**meta.__dict__, "step": 5}), path, streams)
    assert len(peer.opened) == 2


def test_a_refusal_on_the_data_channel_is_the_peers_answer_not_a_channel_failure(node, link, streams, tmp_path):
    meta, path = make_shard(tmp_path, BIG)
    other, _ = make_shard(tmp_path, BIG, "other.data")
    peer = Peer(node, expect=other)  # the receiver finds the first chunk bad, 31 MiB before the sender is done
    talk_to(link, peer)
    with pytest.raises(ReplicaRejected, match=r"chunk 0 .*checksum mismatch"):
        link.put_shard(meta, path, streams)
    assert link._data_channel_off_until == 0.0, "a refusal turned the data channel off"
    assert peer.streamed == [] and link.ranges_sent == {"data_channel": 0, "grpc_stream": 0}


class CutShort:
    """A stand-in TLS context whose nth connection is cut after a few bytes, with no status (the channel fails)."""

    def __init__(self, nth: int) -> None:
        self.connections, self.nth = 0, nth

    def wrap_socket(self, conn: socket.socket, server_hostname: str) -> Any:
        self.connections += 1
        return _Cut(conn) if self.connections == self.nth else conn


class _Cut:
    def __init__(self, conn: socket.socket) -> None:
        self._conn, self._sent = conn, 0

    def sendall(self, data: Any) -> None:
        if self._sent > CHUNK:
            self._conn.shutdown(socket.SHUT_RDWR)
            raise ConnectionResetError(errno.ECONNRESET, "cut short")
        self._conn.sendall(data)
        self._sent += len(data)

    def recv(self, size: int) -> bytes:
        return self._conn.recv(size)

    def __enter__(self) -> _Cut:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()


def test_a_range_cut_short_sends_the_shard_again_under_a_fresh_transfer_by_put_shard(
    node, link, streams, tmp_path, monkeypatch
):
    monkeypatch.setattr(shard_stream, "MIN_RANGE_BYTES", 2 * CHUNK)
    meta, path = make_shard(tmp_path, 8 * CHUNK)  # four ranges: the last is cut short half way
    peer = Peer(node)
    talk_to(link, peer)
    link._data_tls = CutShort(nth=4)  # type: ignore[assignment]
    link.put_shard(meta, path, streams)
    assert received(node, path)
    first = peer.opened[0]
    assert peer.opened == [first] * 4 and peer.sealed and peer.sealed[0] != first
    assert set(peer.streamed) == {peer.sealed[0]} and len(peer.streamed) == 4
    assert link._data_channel_off_until > time.monotonic() + 50  # by PutShard for a minute
