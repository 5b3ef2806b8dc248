"""Translate the peer protocol's messages to calls of the roles that answer them, and back; no logic of its own.

Each RPC is one call into one role, handed over by the composition root (node.py): a replica's
arrival and a peer's CommitStep to SavePath, a peer's fetch to the Locator, its Inventory to
Peering; the replica's bytes go to the ReplicaReceiver.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import grpc
from ckpt_core.byte_range import ByteRange
from ckpt_core.commit_keys import CommitKeys
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.format import CommitRecord, ShardMeta, validate_job, validate_step
from ckpt_core.wire.v1 import peer_pb2 as pb
from ckpt_core.wire.v1 import peer_pb2_grpc

from ckptd.cluster.peer_link import INSTANCE_HEADER, ITSELF, IsSelf, data_piece, holdings_to_pb, piece_data
from ckptd.cluster.shard_stream import read_pieces
from ckptd.config import Config
from ckptd.load.locate import Locator
from ckptd.replication.peering import Peering
from ckptd.replication.receiving import ReplicaReceiver
from ckptd.rpc.data_listener import DataListener
from ckptd.rpc.guard import NotAPeer, RequestGuard
from ckptd.rpc.server import answer
from ckptd.save.save_path import SavePath


def _shard_meta(data: bytes) -> ShardMeta:
    try:
        return ShardMeta.from_bytes(data, "shard record from a peer")
    except CorruptCheckpoint as e:
        raise InvalidArgument(str(e)) from None


def _commit_record(data: bytes, commit_keys: CommitKeys) -> CommitRecord:
    try:
        return CommitRecord.from_bytes(data, "commit record from a peer", commit_keys)
    except CorruptCheckpoint as e:
        raise InvalidArgument(str(e)) from None


def add_peer_servicer(servicer: PeerServicer, server: grpc.aio.Server, guard: RequestGuard) -> None:
    """Serve the peer protocol, with the bulk methods taking and giving serialized pieces as they are."""

    def raw_bulk(handlers: dict[str, Any]) -> None:
        handlers["PutShard"] = handlers["PutShard"]._replace(request_deserializer=None)
        handlers["GetShard"] = handlers["GetShard"]._replace(response_serializer=None)

    guard.register(peer_pb2_grpc.add_CkptdPeerServicer_to_server, servicer, server, raw_bulk)


class PeerServicer(peer_pb2_grpc.CkptdPeerServicer):
    """Serve ckpt_core/wire/v1/peer.proto to other nodes' daemons."""

    def __init__(
        self,
        save_path: SavePath,
        locator: Locator,
        peering: Peering,
        receiver: ReplicaReceiver,
        verification_failed: Callable[[str], None],
        instance: str,
        config: Config,
        serve_threads: ThreadPoolExecutor,
        record_threads: ThreadPoolExecutor,
        data_listener: DataListener | None = None,
        guard: RequestGuard | None = None,
    ) -> None:
        """serve_threads: where GetShard reads and serializes pieces (never in the way of seals);
        record_threads: where the shard and commit records peers send are parsed and checked (Executors.records).

        verification_failed(tier): count a bad byte caught on its way in (StatusReport's). instance: this
        daemon's run, to refuse calls from itself. guard: where a caller refused by admit() is logged, once a
        minute per caller.
        """
        self.save_path = save_path
        self.locator = locator
        self.peering = peering
        self.verification_failed = verification_failed
        self.instance = instance
        self.receiver = receiver
        self.config = config
        self._serve_threads = serve_threads
        self._record_threads = record_threads
        self.data_listener = data_listener  # None: [peer] data_channel = false, ranges come by PutShard
        self._guard = guard or RequestGuard()

    async def _shard_meta(self, transfer: str, raw: bytes) -> ShardMeta:
        """Parse a shard record a peer sent, once per transfer (its layout may be megabytes: on a thread)."""
        known = self.receiver.known_meta(transfer, raw)
        if known is not None:
            return known
        return await asyncio.get_running_loop().run_in_executor(self._record_threads, _shard_meta, raw)

    async def _commit_record_of(self, raw: bytes) -> CommitRecord:
        """Parse and check a commit record a peer sent (a signature, a record of many ranks: on a record thread)."""
        keys = self.config.commit_keys
        return await asyncio.get_running_loop().run_in_executor(self._record_threads, _commit_record, raw, keys)

    def admit(self, context: Any) -> None:
        """Refuse the node itself, and (with TLS) a caller whose certificate names no configured peer's host."""
        if dict(context.invocation_metadata()).get(INSTANCE_HEADER) == self.instance:
            raise IsSelf(f"{ITSELF} a peer address in [peer] addresses leads back to this node")
        config = self.config
        if not config.peer.cert:
            return  # plaintext, as [peer] insecure = true asked
        auth = context.auth_context()
        names = auth.get("x509_subject_alternative_name") or auth.get("x509_common_name") or []
        named = {n.decode(errors="replace") for n in names}
        if not named & config.peer_hosts:
            subject = b", ".join(auth.get("x509_common_name") or []).decode(errors="replace")
            refusal = NotAPeer(
                f"a caller at {context.peer()} presented a certificate for {sorted(named)} (subject CN={subject}), "
                "which names none of the hosts in [peer] addresses"
            )
            self._guard.note(context, "not a peer", f"refused a peer's call: {refusal}")
            raise refusal

    async def PutShard(self, request_iterator: AsyncIterator[bytes], context: Any) -> pb.PutShardReply:
        async def work() -> pb.PutShardReply:
            self.admit(context)
            # Closed here, however the call ends: a stream left to the garbage collector is closed by a
            # finalizer, wherever the collector happens to run (once, deep in parsing a hostile record).
            reader = cast("AsyncGenerator[bytes, None]", aiter(request_iterator))  # gRPC's is a generator
            async with contextlib.aclosing(reader) as stream:
                raw = await anext(stream, None)
                if raw is None:
                    raise InvalidArgument("PutShard carried no pieces")
                first = pb.ShardPiece.FromString(raw)
                meta = await self._shard_meta(first.transfer, first.meta_json)

                async def data() -> AsyncGenerator[memoryview, None]:
                    if first.data:
                        yield memoryview(first.data)
                    async for piece in stream:
                        yield piece_data(piece)

                async with contextlib.aclosing(data()) as pieces:
                    try:
                        byte_range = ByteRange(first.offset, first.length)
                        await self.receiver.receive_range(meta, first.transfer, byte_range, pieces)
                    except CorruptCheckpoint:
                        self.verification_failed("peer")
                        raise
            return pb.PutShardReply()

        return await answer(context, work)

    async def OpenDataRange(self, request: pb.ShardPiece, context: Any) -> pb.DataRangeTicket:
        async def work() -> pb.DataRangeTicket:
            self.admit(context)
            if self.data_listener is None:
                return pb.DataRangeTicket()
            meta = await self._shard_meta(request.transfer, request.meta_json)
            byte_range = ByteRange(request.offset, request.length)
            # Every refusal that needs none of the bytes is made here, as a status: never on the data connection.
            reservation = await self.receiver.reserve_range(meta, request.transfer, byte_range)
            try:
                ticket = self.data_listener.offer(reservation)
            except BaseException:
                self.receiver.release(reservation)
                raise
            return pb.DataRangeTicket(port=self.data_listener.port, ticket=ticket)

        return await answer(context, work)

    async def SealShard(self, request: pb.SealShardRequest, context: Any) -> pb.SealShardReply:
        async def work() -> pb.SealShardReply:
            self.admit(context)
            meta = await self._shard_meta(request.transfer, request.meta_json)
            record = await self._commit_record_of(request.commit_json) if request.commit_json else None
            await self.receiver.seal(meta, request.transfer)
            await self.save_path.replica_arrived(meta, record)
            return pb.SealShardReply()

        return await answer(context, work)

    async def GetShard(self, request: pb.GetShardRequest, context: Any) -> AsyncIterator[bytes]:
        async def find() -> tuple[ShardMeta, bytes, Any]:
            self.admit(context)
            job, step = validate_job(request.job), validate_step(request.step)
            return await self.locator.shard_for_peer(job, step, request.rank, request.tier)

        meta, meta_json, path = await answer(context, find)
        yield pb.ShardPiece(meta_json=meta_json).SerializeToString()
        if request.meta_only:
            return
        what = f"rank {meta.rank} shard of {meta.job} step {meta.step} on node {self.config.node.name}"
        wanted = ByteRange(request.offset, request.length) if request.ranged else ByteRange.whole(meta.data_size_bytes)
        if wanted.offset % meta.chunk_size_bytes or not 0 <= wanted.offset <= wanted.end <= meta.data_size_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: no such range {wanted}")
        pieces = read_pieces(path, meta, wanted, what)
        loop = asyncio.get_running_loop()

        def serialize_next() -> bytes | None:
            data = next(pieces, None)
            return None if data is None else data_piece(data)

        async def next_piece() -> bytes | None:
            return await loop.run_in_executor(self._serve_threads, serialize_next)

        while (piece := await answer(context, next_piece)) is not None:
            yield piece  # already a serialized ShardPiece

    async def Inventory(self, request: pb.InventoryRequest, context: Any) -> pb.InventoryReply:
        async def work() -> pb.InventoryReply:
            self.admit(context)
            job = validate_job(request.job) if request.job else ""
            step = None if request.step == -1 else validate_step(request.step)
            steps = await self.peering.holdings(job, step)
            return pb.InventoryReply(node=self.config.node.name, steps=holdings_to_pb(steps))

        return await answer(context, work)

    async def RetireReplica(self, request: pb.RetireReplicaRequest, context: Any) -> pb.RetireReplicaReply:
        async def work() -> pb.RetireReplicaReply:
            self.admit(context)
            job, step = validate_job(request.job), validate_step(request.step)
            if request.rank < 0 or len(request.meta_xxh3_128) != 32:
                raise InvalidArgument(f"invalid rank {request.rank} or digest {request.meta_xxh3_128[:40]!r}")
            removed = await self.receiver.retire(job, step, request.rank, request.meta_xxh3_128)
            return pb.RetireReplicaReply(removed=removed)

        return await answer(context, work)

    async def CommitStep(self, request: pb.CommitStepRequest, context: Any) -> pb.CommitStepReply:
        async def work() -> pb.CommitStepReply:
            self.admit(context)
            await self.save_path.adopt_commit(await self._commit_record_of(request.commit_json))
            return pb.CommitStepReply()

        return await answer(context, work)
