"""Talk to another node's daemon over the peer protocol: send replicas, ask inventories, fetch shards.

Blocking calls, made from worker threads (never from the event loop). Every
failure is a PeerError naming the peer; a peer taking as many replicas as it can now
is PeerBusy (ask again: no failure); a replica the peer rejected for a bad chunk is a
ReplicaRejected; a TLS handshake refused over a certificate (the peer's, or this node's)
is a CertificateRefused saying which and why (tls_refusal); a peer that does not answer
(no connection, a dead one, a deadline) is a PeerUnreachable. A replica the peer holds
already is AlreadyHeld, as it is on any tier.
"""

from __future__ import annotations

import logging
import math
import resource
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from ckpt_core.byte_range import WHOLE, ByteRange, ByteRequest
from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, digest, validate_job, validate_step
from ckpt_core.wire.v1 import peer_pb2 as pb
from ckpt_core.wire.v1 import peer_pb2_grpc

from ckptd.addresses import host_of
from ckptd.cluster import tls_refusal
from ckptd.cluster.data_channel import DataChannelError, client_context, send_range
from ckptd.cluster.placement import Holding, StepHoldings
from ckptd.cluster.shard_stream import byte_ranges, fill_from_pieces, read_pieces
from ckptd.config import PeerConfig
from ckptd.errors import AlreadyHeld, PeerBusy, PeerError

MAX_MESSAGE_BYTES = 64 << 20
INSTANCE_HEADER = "ckptd-instance"
ITSELF = "itself:"  # how a daemon answers a call from itself
STREAMS_PER_SHARD = 4
CALL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0
DATA_CHANNEL_RETRY_S = 60.0  # after the data channel failed, ranges go by PutShard this long
MIN_TRANSFER_BYTES_PER_S = 2 << 20  # a stream slower than this is given up and retried (think 1 GbE, 8 streams)

log = logging.getLogger(__name__)

_DATA_TAG = b"\x2a"  # ShardPiece field 5 (data), length-delimited


def data_piece(data: memoryview) -> bytes:
    """Serialize ShardPiece(data=data) exactly as protobuf would, with one copy of the bytes."""
    if not data:
        return b""  # protobuf leaves an empty field out
    n, varint = len(data), bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        varint.append(byte | (0x80 if n else 0))
        if not n:
            break
    return b"".join((_DATA_TAG, varint, data))


def piece_data(message: bytes) -> memoryview:
    """Return the data of a serialized ShardPiece without copying it (the bulk path skips protobuf's copies)."""
    view = memoryview(message)
    if view[:1] == _DATA_TAG:
        length, shift, i = 0, 0, 1
        while i < len(view):
            byte = view[i]
            length |= (byte & 0x7F) << shift
            shift, i = shift + 7, i + 1
            if not byte & 0x80:
                break
        if i + length == len(view):
            return view[i:]
    return memoryview(pb.ShardPiece.FromString(message).data)  # any other shape protobuf allows


class IsSelf(PeerError):
    """The address leads back to this very daemon (an alias of its own in the peer list)."""


class ReplicaRejected(PeerError):
    """The peer found a bad chunk in a replica it received (the sender's copy or the wire is at fault)."""


class PeerUnreachable(PeerError):
    """The peer did not answer: no connection, a connection that died (keepalive), or a call past its deadline."""


class CertificateRefused(PeerError):
    """A TLS handshake with the peer failed over a certificate: "certificate rejected by" or "... not trusted"."""


KEEPALIVE_TIME_S = 1.0  # a ping on every peer connection this often, calls or none
KEEPALIVE_TIMEOUT_S = 2.0  # a ping unanswered this long: the connection is dead (its calls fail UNAVAILABLE)


def grpc_options() -> list[tuple[str, Any]]:
    """Return the channel and server options of the peer protocol.

    Keepalive: a connection whose peer stopped answering (a cut link, a hung host) is closed
    within KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S, failing its calls, rather than reused until a call's deadline or the
    kernel's retransmissions (which back off to minutes) give up on it; the next call connects
    afresh, so a healed link is used at once. Pings go also on idle connections, and without
    data between them (gRPC's defaults stop after two).
    """
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # A peer that comes back is seen within a second, not after gRPC's default of up to two minutes.
        # The minimum is also how long a connection attempt may take: one into a cut link gives up soon.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


SERVER_HANDSHAKE_TIMEOUT_MS = 5000  # a connection that has not finished TLS by then is closed (gRPC's default: 120 s)
CONNECTIONS_SHARE_OF_DESCRIPTORS = 0.5  # of the process's descriptor limit, at most, held by a peer-port server


def server_options() -> list[tuple[str, Any]]:
    """Return the options of a server on the peer port: exclusive, and quick to drop who never authenticates.

    gRPC binds with SO_REUSEPORT by default: a second daemon on a used address would share it, each
    taking a random half of the connections. Off, the second one fails to bind and exits 2.
    Connections past max_incoming_connections() are closed at accept, so that whoever reaches the
    port cannot take the descriptors that saves, slots and shards need (gRPC has no limit per source:
    docs/OPERATIONS.md, Security).
    """
    return [
        *grpc_options(),
        # The peers' keepalive pings are welcome, idle or not, however often they come (else gRPC answers
        # pings closer than five minutes apart with "too many pings" and closes the connection).
        ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_TIME_S * 1000 / 2)),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_allowed_incoming_connections", max_incoming_connections()),
    ]


def max_incoming_connections() -> int:
    """Return how many connections a peer-port server holds at once: half the process's descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, int(soft * CONNECTIONS_SHARE_OF_DESCRIPTORS))


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(peer: PeerConfig) -> grpc.ServerCredentials | None:
    """Return TLS credentials that require a client certificate signed by peer.ca, or None without TLS."""
    if not peer.cert:
        return None
    return grpc.ssl_server_credentials(
        [(_read(peer.key), _read(peer.cert))], root_certificates=_read(peer.ca), require_client_auth=True
    )


def channel_credentials(peer: PeerConfig) -> grpc.ChannelCredentials | None:
    """Return TLS credentials presenting peer.cert and trusting peer.ca, or None without TLS."""
    if not peer.cert:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(peer.ca), private_key=_read(peer.key), certificate_chain=_read(peer.cert)
    )


def holdings_to_pb(steps: list[StepHoldings]) -> list[pb.StepHoldings]:
    """Turn a node's holdings into Inventory messages."""
    return [
        pb.StepHoldings(
            job=s.job,
            step=s.step,
            commit_json=s.record.to_bytes() if s.record else b"",
            shards=[
                pb.Holding(
                    tier=h.tier,
                    rank=h.rank,
                    world_size=h.world_size,
                    data_size_bytes=h.data_size_bytes,
                    meta_xxh3_128=h.meta_digest,
                    run_id=h.run_id,
                    line=h.line,
                    saved_at=h.saved_at,
                )
                for h in s.shards
            ],
        )
        for s in steps
    ]


def holdings_from_pb(node: str, steps: Any, commit_keys: CommitKeys) -> list[StepHoldings]:
    """Turn Inventory messages from a peer into holdings, validating every name (and commit record) in them."""
    found = []
    for s in steps:
        job, step = validate_job(s.job), validate_step(s.step)
        record = (
            CommitRecord.from_bytes(s.commit_json, f"{job} step {step} from {node}", commit_keys)
            if s.commit_json
            else None
        )
        if record is not None and (record.job, record.step) != (job, step):
            raise CorruptCheckpoint(f"{node} sent the commit record of {record.job} step {record.step} for step {step}")
        shards = tuple(
            Holding(
                node,
                h.tier,
                job,
                step,
                h.rank,
                h.world_size,
                h.data_size_bytes,
                h.meta_xxh3_128,
                h.run_id,
                h.line,
                h.saved_at,
            )
            for h in s.shards
            if h.tier in ("nvme", "peer") and 0 <= h.rank < h.world_size
        )
        found.append(StepHoldings(node, job, step, record, shards))
    return found


class PeerLink:
    """One peer daemon, reached over one gRPC channel (TLS when configured)."""

    def __init__(
        self, address: str, peer: PeerConfig, instance: str = "", tls_name: str = "", commit_keys: CommitKeys = UNSIGNED
    ) -> None:
        """instance names this daemon's run: a peer that finds its own in a call refuses it (IsSelf).

        commit_keys (Config.commit_keys): the commit records the peer's inventory names must be signed by one of them.

        tls_name: the name the peer's certificate must carry, where it is not the address's host
        (an "ip:port" found by resolving a name in [peer] addresses: the name, as dialled before).
        """
        self.address = address
        self.commit_keys = commit_keys
        self._peer = peer
        self._tls_name = tls_name or host_of(address)
        self._metadata = ((INSTANCE_HEADER, instance),) if instance else ()
        credentials = channel_credentials(peer)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=grpc_options())
        else:
            options = (
                [*grpc_options(), ("grpc.ssl_target_name_override", self._tls_name)] if tls_name else grpc_options()
            )
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._stub = peer_pb2_grpc.CkptdPeerStub(self._channel)
        # The bulk methods carry pre-serialized pieces: the same bytes on the wire, without protobuf's copies.
        self._put_shard = self._channel.stream_unary(
            "/ckpt.wire.v1.CkptdPeer/PutShard", response_deserializer=pb.PutShardReply.FromString
        )
        self._get_shard = self._channel.unary_stream(
            "/ckpt.wire.v1.CkptdPeer/GetShard", request_serializer=pb.GetShardRequest.SerializeToString
        )
        self._data_tls = client_context(peer)
        # Ranges go on the peer's data channel while it offers one; after a failure, by PutShard for a while.
        self._data_channel_off_until = 0.0 if peer.data_channel else math.inf
        self.ranges_sent = {"data_channel": 0, "grpc_stream": 0}  # for status: which way the bytes went
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Wait up to timeout_s for the channel to be ready: a peer that just came back gets a fair chance."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            # Else gRPC's thread watching the channel for it lives on, and raises when close() comes.
            ready.cancel()
            refusal = self._certificate_refusal("")
            if refusal is not None:
                raise CertificateRefused(refusal) from None
            raise PeerUnreachable(f"peer {self.address}: not reachable within {timeout_s:.0f} s") from None

    def _certificate_refusal(self, details: str) -> str | None:
        """Return the error for a refused certificate, from gRPC's details (UNAVAILABLE) or a handshake of our own.

        gRPC's details carry this node's refusal of the peer's certificate; the peer's refusal
        of ours reaches them only as "Socket closed" (a gRPC server sends no alert), and a
        channel that never became ready carries no details at all: then tls_refusal.probe asks.
        """
        if not self._peer.cert:
            return None
        said = tls_refusal.sender_error(self.address, details)
        if said is not None or (details and "Socket closed" not in details):
            return said
        port = self.address.rsplit(":", 1)[1]
        if not port.isdigit():
            return None
        return tls_refusal.probe(self.address, host_of(self.address), int(port), self._peer, self._tls_name)

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except grpc.RpcError as e:
            raise self._error(e.code().name, e.details() or e.code().name, what) from None

    def _error(self, code: str, detail: str, what: str) -> CheckpointError:
        """Return the error for a peer's answer: a gRPC status name and its detail."""
        if code == "FAILED_PRECONDITION" and detail.startswith(ITSELF):
            return IsSelf(f"peer {self.address} is this node itself")
        if code == "ALREADY_EXISTS":
            return AlreadyHeld(f"peer {self.address}: {detail}")
        if code == "RESOURCE_EXHAUSTED":
            return PeerBusy(f"peer {self.address}: {what}: busy, {detail}")
        if code == "DATA_LOSS":
            return ReplicaRejected(f"peer {self.address} rejected {what}: {detail}")
        if code == "NOT_FOUND":
            return NotFound(f"peer {self.address}: {detail}")
        if code == "UNAVAILABLE" and (refusal := self._certificate_refusal(detail)) is not None:
            return CertificateRefused(refusal)
        if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            return PeerUnreachable(f"peer {self.address}: {what} failed: {code} {detail}")
        return PeerError(f"peer {self.address}: {what} failed: {code} {detail}")

    def inventory(
        self, job: str = "", step: int = -1, timeout_s: float = CALL_TIMEOUT_S, wait_for_ready: bool = False
    ) -> list[StepHoldings]:
        """Return what the peer holds of a job's step (or of everything).

        wait_for_ready: wait (within timeout_s) for the channel to connect rather than fail at once while
        gRPC backs off after a failed connection (a peer that just came up answers the next attempt).
        """
        reply = self._call(
            "inventory",
            lambda: self._stub.Inventory(
                pb.InventoryRequest(job=job, step=step),
                timeout=timeout_s,
                metadata=self._metadata,
                wait_for_ready=wait_for_ready,
            ),
        )
        try:
            return holdings_from_pb(
                self.address, reply.steps, self.commit_keys
            )  # nodes are known by address in the cluster view
        except CheckpointError as e:
            raise PeerError(f"peer {self.address} sent a bad inventory: {e}") from None

    def commit_step(self, record: CommitRecord, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Tell the peer a step is complete."""
        self._call(
            f"commit of {record.job} step {record.step}",
            lambda: self._stub.CommitStep(
                pb.CommitStepRequest(commit_json=record.to_bytes()), timeout=timeout_s, metadata=self._metadata
            ),
        )

    def retire_replica(self, meta: ShardMeta, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Have the peer drop its replica of a shard (it stood in for the placed node); return whether it held it."""
        reply = self._call(
            f"retiring the replica of rank {meta.rank} shard of {meta.job} step {meta.step}",
            lambda: self._stub.RetireReplica(
                pb.RetireReplicaRequest(
                    job=meta.job, step=meta.step, rank=meta.rank, meta_xxh3_128=digest(meta.to_bytes())
                ),
                timeout=timeout_s,
                metadata=self._metadata,
            ),
        )
        return bool(reply.removed)

    def put_shard(
        self, meta: ShardMeta, path: Path, streams: ThreadPoolExecutor, record: CommitRecord | None = None
    ) -> None:
        """Send a replica of a shard read from path, on several streams at once, and have the peer seal it."""
        what = f"rank {meta.rank} shard of {meta.job} step {meta.step}"
        self.connect()
        meta_json = meta.to_bytes()
        ranges = byte_ranges(meta, STREAMS_PER_SHARD)
        for tries_left in (1, 0):
            transfer = uuid.uuid4().hex
            sends = [streams.submit(self._put_range, meta, meta_json, transfer, path, r, what) for r in ranges]
            errors = [e for f in sends if (e := f.exception()) is not None]
            # The data channel failed under a range: the receiver dropped that transfer. The whole
            # shard goes again under a new one, by PutShard now that the channel is off.
            if not tries_left or not any(isinstance(e, DataChannelError) for e in errors):
                break
        if errors and all(isinstance(e, AlreadyHeld) for e in errors):
            return  # sent before (a resume, or a retry after a lost answer): nothing to do
        if errors:
            raise next(e for e in errors if not isinstance(e, AlreadyHeld))
        request = pb.SealShardRequest(
            meta_json=meta_json, transfer=transfer, commit_json=record.to_bytes() if record else b""
        )
        self._call(
            f"sealing the replica of {what}",
            lambda: self._stub.SealShard(request, timeout=CALL_TIMEOUT_S, metadata=self._metadata),
        )

    def _put_range(
        self, meta: ShardMeta, meta_json: bytes, transfer: str, path: Path, byte_range: ByteRange, what: str
    ) -> None:
        """Send one range: on the peer's data channel where it offers one, else by PutShard."""
        way = "grpc_stream"
        if time.monotonic() >= self._data_channel_off_until and self._put_on_data_channel(
            meta, meta_json, transfer, path, byte_range, what
        ):
            way = "data_channel"
        else:
            self._put_by_stream(meta, meta_json, transfer, path, byte_range, what)
        with self._lock:
            self.ranges_sent[way] += 1

    def _put_on_data_channel(
        self, meta: ShardMeta, meta_json: bytes, transfer: str, path: Path, byte_range: ByteRange, what: str
    ) -> bool:
        """Send a range on a data connection; return False where the peer offers none.

        DataChannelError (after which ranges go by PutShard for DATA_CHANNEL_RETRY_S) only where
        the channel itself failed; a refusal, on gRPC or on the connection, is the PeerError it names.
        """
        request = pb.ShardPiece(
            meta_json=meta_json, transfer=transfer, offset=byte_range.offset, length=byte_range.length
        )
        try:
            offer = self._stub.OpenDataRange(request, timeout=CALL_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:  # a peer of before the data channel: PutShard
                raise self._error(e.code().name, e.details() or e.code().name, f"replica of {what}") from None
            offer = pb.DataRangeTicket()
        if not offer.port:
            self._data_channel_off_until = time.monotonic() + DATA_CHANNEL_RETRY_S
            return False
        try:
            status = send_range(
                host_of(self.address),
                offer.port,
                offer.ticket,
                self._data_tls,
                path,
                meta,
                byte_range,
                what,
                self._tls_name,
            )
        except DataChannelError as e:
            log.warning(
                "peer %s: the data channel failed (%s); sending replicas by gRPC for %.0f s",
                self.address, e, DATA_CHANNEL_RETRY_S,
            )  # fmt: skip
            self._data_channel_off_until = time.monotonic() + DATA_CHANNEL_RETRY_S
            raise
        if status != "OK":  # a refusal, said by the receiver: the channel works
            code, _, detail = status.partition(" ")
            raise self._error(code, detail, f"replica of {what}")
        return True

    def _put_by_stream(
        self, meta: ShardMeta, meta_json: bytes, transfer: str, path: Path, byte_range: ByteRange, what: str
    ) -> None:
        local_failure: list[BaseException] = []

        def pieces() -> Iterator[bytes]:
            # A local copy that changed (a staging slot reused) or went ends the stream early,
            # which the receiver refuses as short; raising here would only get logged by gRPC
            # as an error and reported as CANCELLED.
            try:
                first = pb.ShardPiece(
                    meta_json=meta_json, transfer=transfer, offset=byte_range.offset, length=byte_range.length
                )
                yield first.SerializeToString()
                for data in read_pieces(path, meta, byte_range, f"{what} at {path}"):
                    yield data_piece(data)
            except (CheckpointError, OSError) as e:
                local_failure.append(e)

        timeout_s = CALL_TIMEOUT_S + byte_range.length / MIN_TRANSFER_BYTES_PER_S
        try:
            self._call(
                f"replica of {what}", lambda: self._put_shard(pieces(), timeout=timeout_s, metadata=self._metadata)
            )
        except (PeerError, AlreadyHeld):
            if not local_failure:
                raise
        if local_failure:
            raise local_failure[0]

    def fetch_meta(self, job: str, step: int, rank: int, tier: str = "") -> ShardMeta:
        """Return the record of a rank's shard of a complete step that the peer holds."""
        request = pb.GetShardRequest(job=job, step=step, rank=rank, tier=tier, meta_only=True)
        what = f"rank {rank} shard record of {job} step {step}"
        for raw in self._call(what, lambda: list(self._get_shard(request, timeout=CALL_TIMEOUT_S))):
            return ShardMeta.from_bytes(pb.ShardPiece.FromString(raw).meta_json, f"{what} from peer {self.address}")
        raise PeerError(f"peer {self.address} sent nothing for {what}")

    def fetch_into(self, meta: ShardMeta, buffer: memoryview, wanted: ByteRequest = WHOLE, tier: str = "") -> None:
        """Fill buffer with the wanted bytes of a shard from the peer (from its first byte), every chunk checked."""
        byte_range = wanted.resolve(meta.data_size_bytes)
        offset, length = byte_range.offset, byte_range.length
        request = pb.GetShardRequest(
            job=meta.job, step=meta.step, rank=meta.rank, tier=tier, offset=offset, length=length, ranged=True
        )
        what = f"rank {meta.rank} shard of {meta.job} step {meta.step} from peer {self.address}"
        timeout_s = CALL_TIMEOUT_S + length / MIN_TRANSFER_BYTES_PER_S

        def fill() -> None:
            replies = iter(self._get_shard(request, timeout=timeout_s))
            first = next(replies, None)
            if first is None or pb.ShardPiece.FromString(first).meta_json != meta.to_bytes():
                raise CorruptCheckpoint(f"{what}: the peer holds a different copy of the shard")
            fill_from_pieces(buffer, meta, (piece_data(r) for r in replies), what, byte_range)

        self._call(what, fill)
