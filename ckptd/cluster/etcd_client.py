"""A thin asyncio client of etcd's v3 API over our own stubs (protos/ckptd/cluster/etcd_wire/).

EtcdView and EtcdMembership (ckptd.cluster.etcd_view, etcd_membership) make every call,
on the event loop. Why our own stubs rather than a client package: the old `etcd3` does
not run on current protobuf, and the asyncio clients pin grpcio and protobuf ranges of
their own; a dozen calls over the grpc.aio we already ship cost one trimmed .proto.

Each call goes to the endpoint that answered last, waiting within the timeout for its
channel to connect again (an etcd restarting is no error); on UNAVAILABLE or a deadline
it tries the next, failing fast, and raises EtcdUnavailable once every endpoint failed
(callers retry at their own pace). Requests and bytes are counted per method in `counters`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from ckpt_core.errors import CheckpointError

from ckptd.cluster.etcd_wire import kv_pb2 as kv
from ckptd.cluster.etcd_wire import kv_pb2_grpc, lease_pb2_grpc, watch_pb2_grpc
from ckptd.cluster.etcd_wire import lease_pb2 as lease_pb
from ckptd.cluster.etcd_wire import watch_pb2 as watch_pb

STUBS = {"KV": kv_pb2_grpc.KVStub, "Lease": lease_pb2_grpc.LeaseStub}  # the services of unary calls

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
RECONNECT_FIRST_MS = 100
RECONNECT_MAX_MS = 1000
KEEPALIVE_TIME_MS = 6000  # etcd's --grpc-keepalive-min-time is 5 s by default
KEEPALIVE_TIMEOUT_MS = 2000


class EtcdError(CheckpointError):
    """etcd refused a request."""


class EtcdUnavailable(EtcdError):
    """No endpoint of etcd answered."""


class EtcdCompacted(EtcdError):
    """A watch asked for history etcd has compacted away; read the keys whole, then watch from there."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class Entry:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: bytes
    value: bytes
    mod_revision: int


def prefix_end(prefix: bytes) -> bytes:
    """Return the end of the range of keys that start with prefix (etcd's convention: the last byte plus one)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key from prefix on
    end[-1] += 1
    return bytes(end)


def _stream_failure(e: Exception) -> str:
    """Say in a few words why a call on a stream failed."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return "no answer in time" if isinstance(e, TimeoutError) else "the stream had ended"


class EtcdClient:
    """Calls to one etcd cluster, through whichever of its endpoints answers.

    Every method runs on the event loop that made the first call (channels are opened
    lazily, on first use, and belong to that loop); close() comes last. Calls may run
    concurrently; lease renewals share one stream and take turns on it.
    """

    def __init__(
        self, endpoints: Sequence[str], cert: str = "", key: str = "", ca: str = "", timeout_s: float = 3.0
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        # TLS as soon as one PEM is named ([cluster] config asks for all three: a client certificate);
        # a CA alone verifies etcd without presenting one, which etcd with --client-cert-auth refuses.
        pems = [Path(p).read_bytes() if p else None for p in (ca, key, cert)]
        self._credentials = grpc.ssl_channel_credentials(*pems) if any(pems) else None
        self._current = 0
        self._answered = False  # whether endpoints[_current] has answered a call
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._keep_alive: tuple[str, Any] | None = None  # the open LeaseKeepAlive stream and its endpoint
        self._keep_alive_turn = asyncio.Lock()  # one request, then its reply, on that stream
        self.counters: Counter[str] = Counter()  # "sent.<method>", "sent_bytes.<method>", "received_bytes.<method>"

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        if endpoint not in self._channels:
            options = [
                ("grpc.max_receive_message_length", 64 << 20),
                # an etcd back after an outage is dialled again within RECONNECT_MAX_MS, not gRPC's 120 s
                # (not min_reconnect_backoff_ms: gRPC takes it for the connect timeout, 20 s by default)
                ("grpc.initial_reconnect_backoff_ms", RECONNECT_FIRST_MS),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
                # An endpoint cut off (no answer, no reset) is noticed within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS
                # and the next one tried, rather than the watch waiting on a dead connection for the kernel's
                # retransmissions. Not more often: etcd answers pings under 5 s apart with GOAWAY (too_many_pings).
                ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                ("grpc.http2.max_pings_without_data", 0),  # the watch may carry nothing for long
            ]
            self._channels[endpoint] = (
                grpc.aio.insecure_channel(endpoint, options=options)
                if self._credentials is None
                else grpc.aio.secure_channel(endpoint, self._credentials, options=options)
            )
        return self._channels[endpoint]

    async def _call(self, service: str, method: str, request: Any) -> Any:
        """Make a unary call on the endpoint that answered last, else on the next ones in turn."""
        self.counters[f"sent.{method}"] += 1
        self.counters[f"sent_bytes.{method}"] += request.ByteSize()
        errors = []
        for i in range(len(self.endpoints)):
            index = (self._current + i) % len(self.endpoints)
            endpoint = self.endpoints[index]
            stub = STUBS[service](self._channel(endpoint))
            try:
                # The endpoint that answered last is waited for (within the timeout), as etcd's own
                # clientv3 does, so a restart in progress is no error; the others fail fast.
                wait = self._answered and i == 0
                reply = await getattr(stub, method)(request, timeout=self.timeout_s, wait_for_ready=wait)
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise EtcdError(f"etcd at {endpoint}: {method} failed: {e.code().name} {e.details()}") from None
                errors.append(f"{endpoint}: {e.code().name}")
                continue
            self._current, self._answered = index, True
            self.counters[f"received_bytes.{method}"] += reply.ByteSize()
            return reply
        raise EtcdUnavailable(f"etcd did not answer {method} ({'; '.join(errors)})")

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Set a key; return the store's revision after it."""
        reply = await self._call("KV", "Put", kv.PutRequest(key=key, value=value, lease=lease))
        return int(reply.header.revision)

    async def get(self, key: bytes) -> bytes | None:
        """Return a key's value, or None when it does not exist."""
        reply = await self._call("KV", "Range", kv.RangeRequest(key=key))
        return bytes(reply.kvs[0].value) if reply.kvs else None

    async def get_prefix(
        self, prefix: bytes, *, limit: int = 0, descending: bool = False, keys_only: bool = False
    ) -> tuple[list[Entry], int]:
        """Return the keys under prefix, in key order (or reversed), and the store's revision they reflect."""
        order = kv.RangeRequest.DESCEND if descending else kv.RangeRequest.ASCEND
        request = kv.RangeRequest(
            key=prefix, range_end=prefix_end(prefix), limit=limit, keys_only=keys_only, sort_order=order
        )
        reply = await self._call("KV", "Range", request)
        entries = [Entry(bytes(e.key), bytes(e.value), e.mod_revision, e.create_revision) for e in reply.kvs]
        return entries, int(reply.header.revision)

    async def delete(self, key: bytes) -> int:
        """Delete a key; return how many keys went (0 or 1)."""
        return int((await self._call("KV", "DeleteRange", kv.DeleteRangeRequest(key=key))).deleted)

    async def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under prefix; return how many went."""
        request = kv.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix))
        return int((await self._call("KV", "DeleteRange", request)).deleted)

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Set a key only if it does not exist (a Txn on create_revision 0); return whether it was created.

        A call that timed out on one endpoint and was answered by the next may have created the
        key on the first: then it says False for a key holding its own value.
        """
        absent = kv.Compare(key=key, result=kv.Compare.EQUAL, target=kv.Compare.CREATE, create_revision=0)
        put = kv.RequestOp(request_put=kv.PutRequest(key=key, value=value, lease=lease))
        reply = await self._call("KV", "Txn", kv.TxnRequest(compare=[absent], success=[put]))
        return bool(reply.succeeded)

    async def compact(self, revision: int) -> None:
        """Drop the history before revision: watches from before it end with EtcdCompacted."""
        await self._call("KV", "Compact", kv.CompactionRequest(revision=revision))

    async def grant_lease(self, ttl_s: int) -> int:
        """Return the ID of a new lease of ttl_s seconds (etcd may raise a short TTL to its minimum)."""
        reply = await self._call("Lease", "LeaseGrant", lease_pb.LeaseGrantRequest(TTL=ttl_s))
        if reply.error:
            raise EtcdError(f"etcd at {self.endpoints[self._current]} refused a lease of {ttl_s} s: {reply.error}")
        return int(reply.ID)

    async def revoke(self, lease: int) -> None:
        """End a lease now; the keys put with it go with it."""
        await self._call("Lease", "LeaseRevoke", lease_pb.LeaseRevokeRequest(ID=lease))

    async def keep_alive_once(self, lease: int) -> int:
        """Renew a lease once; return its TTL now (0 or less: the lease is gone). The stream stays open.

        A stream that broke since the last renewal is opened again, on each endpoint in turn.
        """
        self.counters["sent.LeaseKeepAlive"] += 1
        errors = []
        async with self._keep_alive_turn:
            for _ in range(len(self.endpoints) + (self._keep_alive is not None)):
                if self._keep_alive is None:
                    endpoint = self.endpoints[self._current]
                    self._keep_alive = endpoint, lease_pb2_grpc.LeaseStub(self._channel(endpoint)).LeaseKeepAlive()
                endpoint, stream = self._keep_alive
                try:
                    await asyncio.wait_for(stream.write(lease_pb.LeaseKeepAliveRequest(ID=lease)), self.timeout_s)
                    reply = await asyncio.wait_for(stream.read(), self.timeout_s)
                    if reply is not grpc.aio.EOF:
                        return int(reply.TTL)
                    errors.append(f"{endpoint}: the stream ended")
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError) as e:
                    errors.append(f"{endpoint}: {_stream_failure(e)}")
                except asyncio.CancelledError:
                    self._end_keep_alive()  # else the reply to this request would answer the next renewal
                    raise
                self._end_keep_alive()
                self._move_past(endpoint)
        raise EtcdUnavailable(f"etcd did not renew lease {lease:x} ({'; '.join(errors)})")

    async def watch_prefix(self, prefix: bytes, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Yield the puts and deletes under prefix from start_revision (0: from now), in order, until cancelled.

        Raises EtcdUnavailable when the stream breaks (resume from the last mod_revision + 1),
        EtcdCompacted when start_revision is older than etcd's history.
        """
        endpoint = self.endpoints[self._current]  # a broken watch moves on: the caller's next watch tries the next
        call = watch_pb2_grpc.WatchStub(self._channel(endpoint)).Watch()
        create = watch_pb.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix), start_revision=start_revision)
        try:
            await call.write(watch_pb.WatchRequest(create_request=create))
            self.counters["sent.Watch"] += 1
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise EtcdUnavailable(f"etcd at {endpoint} ended the watch of {prefix!r}")
                if reply.compact_revision:
                    raise EtcdCompacted(
                        f"etcd at {endpoint} compacted the history of {prefix!r} past revision {start_revision}",
                        int(reply.compact_revision),
                    )
                if reply.canceled:
                    raise EtcdError(f"etcd at {endpoint} cancelled the watch of {prefix!r}: {reply.cancel_reason}")
                for e in reply.events:
                    self.counters["received.watch_event"] += 1
                    self.counters["received_bytes.watch_event"] += e.ByteSize()
                    kind = "delete" if e.type == watch_pb.Event.DELETE else "put"
                    yield WatchEvent(kind, bytes(e.kv.key), bytes(e.kv.value), int(e.kv.mod_revision))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            self._move_past(endpoint)
            raise EtcdUnavailable(f"etcd at {endpoint}: the watch of {prefix!r} broke: {_stream_failure(e)}") from None
        finally:
            call.cancel()

    def _move_past(self, endpoint: str) -> None:
        """After a stream on the endpoint calls go to broke, go to the next (a stranger till it answers)."""
        if self.endpoints[self._current] != endpoint:
            return  # the calls moved on already
        index = (self._current + 1) % len(self.endpoints)
        if index != self._current:
            self._current, self._answered = index, False

    def _end_keep_alive(self) -> None:
        if self._keep_alive is not None:
            self._keep_alive[1].cancel()
            self._keep_alive = None

    async def close(self) -> None:
        """Close the lease stream and every channel; the client is not used after it."""
        self._end_keep_alive()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
