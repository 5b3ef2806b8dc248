"""Translate the CkptdCluster service (ckpt_core/wire/v1/cluster.proto) to PeersView calls and back; no logic here.

daemon.py adds it to the peer server beside CkptdPeer (same port, same TLS, same
admission); tests and benchmarks/bench_cluster.py serve it alone with serve_cluster().
Runs on the event loop, but the records received, parsed and checked on the record threads
given at construction (Executors.records). Messages and bytes received are counted per kind.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import grpc
from ckpt_core.commit_keys import CommitKeys
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import CommitRecord, validate_job, validate_step
from ckpt_core.wire.v1 import cluster_pb2 as pb
from ckpt_core.wire.v1 import cluster_pb2_grpc

from ckptd.cluster.cluster_link import records_from_pb
from ckptd.cluster.peer_link import holdings_from_pb, holdings_to_pb, server_credentials, server_options
from ckptd.cluster.placement import Holding, StepHoldings
from ckptd.config import PeerConfig
from ckptd.errors import PeerError
from ckptd.rpc.guard import RequestGuard
from ckptd.rpc.server import answer


class ClusterHandler(Protocol):
    """What serves the calls: PeersView."""

    counters: Counter[str]
    commit_keys: CommitKeys  # the records peers send must be signed by one of them

    async def on_report(self, node: str, steps: list[StepHoldings]) -> list[CommitRecord]: ...
    async def on_announce(self, record: CommitRecord, relay: list[str], raw: bytes) -> None: ...
    async def on_digest(self, digests: dict[str, tuple[str, list[int]]]) -> list[CommitRecord]: ...
    async def on_holders(self, job: str, step: int, rank: int) -> list[Holding]: ...


def _records(raw: Sequence[bytes], commit_keys: CommitKeys) -> list[CommitRecord]:
    try:
        return records_from_pb("a peer", raw, commit_keys)
    except PeerError as e:
        raise InvalidArgument(str(e)) from None


class ClusterServicer(cluster_pb2_grpc.CkptdClusterServicer):
    """Serve ckpt_core/wire/v1/cluster.proto; admit(context) refuses callers that are not peers (raises)."""

    def __init__(
        self, handler: ClusterHandler, record_threads: Executor, admit: Callable[[Any], None] = lambda context: None
    ) -> None:
        """record_threads: where the records peers send are parsed and their signatures checked (Executors.records)."""
        self.handler = handler
        self.admit = admit
        self._record_threads = record_threads

    def _received(self, kind: str, request: Any, context: Any) -> None:
        self.admit(context)
        self.handler.counters[f"received.{kind}"] += 1
        self.handler.counters[f"received_bytes.{kind}"] += request.ByteSize()

    async def Report(self, request: pb.ReportRequest, context: Any) -> pb.ReportReply:
        async def work() -> pb.ReportReply:
            self._received("report", request, context)
            if not request.node:
                raise InvalidArgument("Report names no node")
            steps = await asyncio.get_running_loop().run_in_executor(
                self._record_threads, holdings_from_pb, request.node, request.steps, self.handler.commit_keys
            )
            records = await self.handler.on_report(request.node, steps)
            return pb.ReportReply(commit_json=[r.to_bytes() for r in records])

        return await answer(context, work)

    async def Announce(self, request: pb.AnnounceRequest, context: Any) -> pb.AnnounceReply:
        async def work() -> pb.AnnounceReply:
            self._received("announce", request, context)
            (record,) = await asyncio.get_running_loop().run_in_executor(
                self._record_threads, _records, [request.commit_json], self.handler.commit_keys
            )
            await self.handler.on_announce(record, list(request.relay), request.commit_json)
            return pb.AnnounceReply()

        return await answer(context, work)

    async def Digest(self, request: pb.DigestRequest, context: Any) -> pb.DigestReply:
        async def work() -> pb.DigestReply:
            self._received("digest", request, context)
            digests = {validate_job(j.job): (j.digest, list(j.steps)) for j in request.jobs}
            records = await self.handler.on_digest(digests)
            return pb.DigestReply(commit_json=[r.to_bytes() for r in records])

        return await answer(context, work)

    async def Holders(self, request: pb.HoldersRequest, context: Any) -> pb.HoldersReply:
        async def work() -> pb.HoldersReply:
            self._received("holders", request, context)
            job, step = validate_job(request.job), validate_step(request.step)
            held = await self.handler.on_holders(job, step, request.rank)
            by_node = [
                StepHoldings(n, job, step, None, tuple(h for h in held if h.node == n))
                for n in sorted({h.node for h in held})
            ]
            return pb.HoldersReply(
                holders=[
                    pb.NodeHoldings(node=s.node, held=m) for s, m in zip(by_node, holdings_to_pb(by_node), strict=True)
                ]
            )

        return await answer(context, work)


def add_cluster_servicer(
    handler: ClusterHandler,
    server: grpc.aio.Server,
    guard: RequestGuard,
    admit: Callable[[Any], None],
    record_threads: Executor,
) -> None:
    """Serve the cluster view's calls on a server that also serves CkptdPeer (the daemon's peer port)."""
    servicer = ClusterServicer(handler, record_threads, admit)
    guard.register(cluster_pb2_grpc.add_CkptdClusterServicer_to_server, servicer, server)


async def serve_cluster(
    handler: ClusterHandler, listen: str, peer: PeerConfig, record_threads: Executor
) -> tuple[grpc.aio.Server, int]:
    """Serve only the cluster view on listen ("host:0": any free port); return (the server, its port)."""
    server = grpc.aio.server(options=server_options())
    cluster_pb2_grpc.add_CkptdClusterServicer_to_server(ClusterServicer(handler, record_threads), server)
    credentials = server_credentials(peer)
    port = server.add_insecure_port(listen) if credentials is None else server.add_secure_port(listen, credentials)
    await server.start()
    return server, port
