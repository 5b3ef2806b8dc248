"""Call other nodes' CkptdCluster service (ckpt_core/wire/v1/cluster.proto): the built-in cluster view's transport.

PeersView (ckptd.cluster.peers_view) makes every call, on the event loop (grpc.aio).
Channels are opened on first use and the least recently used are closed past
MAX_CHANNELS, so that a node of a 1,000-node cluster holds a few dozen, not one per
peer. Every failure is a PeerError naming the peer. Messages and bytes are counted
per kind in `counters` (ckptd status, benchmarks/bench_cluster.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.errors import CheckpointError, CorruptCheckpoint
from ckpt_core.format import CommitRecord
from ckpt_core.wire.v1 import cluster_pb2 as pb
from ckpt_core.wire.v1 import cluster_pb2_grpc

from ckptd.cluster import tls_refusal
from ckptd.cluster.peer_link import INSTANCE_HEADER, channel_credentials, grpc_options, holdings_from_pb, holdings_to_pb
from ckptd.cluster.placement import Holding, StepHoldings
from ckptd.config import PeerConfig
from ckptd.errors import PeerBusy, PeerError

CALL_TIMEOUT_S = 2.0
MAX_CHANNELS = 64


class PeerSlow(PeerError):
    """The call ran out of time (or was cancelled): the peer may have done it, and may be slow rather than down."""


def records_from_pb(address: str, raw: Sequence[bytes], commit_keys: CommitKeys) -> list[CommitRecord]:
    """Parse commit records a node sent; raise PeerError naming it when one does not check (or is not signed)."""
    try:
        return [CommitRecord.from_bytes(r, f"commit record from {address}", commit_keys) for r in raw]
    except CorruptCheckpoint as e:
        raise PeerError(f"peer {address} sent a bad commit record: {e}") from None


class ClusterLinks:
    """One lazily opened grpc.aio channel per peer address, at most MAX_CHANNELS at once."""

    def __init__(
        self,
        peer: PeerConfig,
        instance: str = "",
        tls_name: Callable[[str], str] = lambda a: "",
        commit_keys: CommitKeys = UNSIGNED,
    ) -> None:
        """tls_name(address): the name the peer's certificate must carry where it is not the address's host.
        commit_keys (Config.commit_keys): the commit records peers send must be signed by one of them."""
        self._peer = peer
        self.commit_keys = commit_keys
        self._credentials = channel_credentials(peer)
        self._metadata = ((INSTANCE_HEADER, instance),) if instance else ()
        self._tls_name = tls_name
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, cluster_pb2_grpc.CkptdClusterStub]] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()
        self.counters: Counter[str] = Counter()  # "sent.<kind>", "sent_bytes.<kind>", "received_bytes.<kind>"

    def _stub(self, address: str) -> cluster_pb2_grpc.CkptdClusterStub:
        if address in self._channels:
            self._channels.move_to_end(address)
            return self._channels[address][1]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=grpc_options())
        else:
            name = self._tls_name(address)
            options = [*grpc_options(), ("grpc.ssl_target_name_override", name)] if name else grpc_options()
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        self._channels[address] = (channel, cluster_pb2_grpc.CkptdClusterStub(channel))
        while len(self._channels) > MAX_CHANNELS:
            _, (old, _) = self._channels.popitem(last=False)
            task = asyncio.get_running_loop().create_task(old.close())  # its calls under way fail over
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return self._channels[address][1]

    async def _call(self, kind: str, address: str, method: str, request: Any) -> Any:
        self.counters[f"sent.{kind}"] += 1
        self.counters[f"sent_bytes.{kind}"] += request.ByteSize()
        try:
            reply = await getattr(self._stub(address), method)(request, timeout=CALL_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            self.counters[f"failed.{kind}.{e.code().name}"] += 1  # for status and bench_cluster
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise PeerBusy(f"peer {address}: {kind}: busy, {e.details()}") from None
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise PeerSlow(f"peer {address}: {kind}: no answer in time ({e.code().name})") from None
            refusal = tls_refusal.sender_error(address, e.details() or "")  # a refused certificate, said plainly
            if e.code() == grpc.StatusCode.UNAVAILABLE and refusal is not None:
                raise PeerError(f"peer {address}: {kind} failed: {refusal}") from None
            raise PeerError(f"peer {address}: {kind} failed: {e.code().name} {e.details()}") from None
        self.counters[f"received_bytes.{kind}"] += reply.ByteSize()
        return reply

    async def report(self, address: str, node: str, steps: list[StepHoldings]) -> list[CommitRecord]:
        """Report this node's holdings of some steps to a coordinator; return the records it knows of them."""
        reply = await self._call("report", address, "Report", pb.ReportRequest(node=node, steps=holdings_to_pb(steps)))
        return records_from_pb(address, reply.commit_json, self.commit_keys)

    async def announce(self, address: str, commit_json: bytes, relay: list[str]) -> None:
        """Tell a node a step is committed (its record, serialized once), and have it pass the news on to relay."""
        await self._call("announce", address, "Announce", pb.AnnounceRequest(commit_json=commit_json, relay=relay))

    async def digest(self, address: str, digests: dict[str, tuple[str, list[int]]]) -> list[CommitRecord]:
        """Compare commit digests ({job: (digest, steps kept)}) with a node; return the records this node lacks."""
        jobs = [pb.JobDigest(job=j, digest=d, steps=steps) for j, (d, steps) in digests.items()]
        reply = await self._call("digest", address, "Digest", pb.DigestRequest(jobs=jobs))
        return records_from_pb(address, reply.commit_json, self.commit_keys)

    async def holders(self, address: str, job: str, step: int, rank: int) -> list[Holding]:
        """Ask a job's coordinator which nodes hold a rank's shard of a step."""
        reply = await self._call("holders", address, "Holders", pb.HoldersRequest(job=job, step=step, rank=rank))
        found: list[Holding] = []
        for s in reply.holders:
            try:
                found += [h for held in holdings_from_pb(s.node, [s.held], self.commit_keys) for h in held.shards]
            except CheckpointError as e:
                raise PeerError(f"peer {address} sent bad holdings: {e}") from None
        return found

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
