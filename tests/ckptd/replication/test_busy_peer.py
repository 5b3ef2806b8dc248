"""A peer that answers "busy" (RESOURCE_EXHAUSTED: receiving as many replicas as it takes) is not a failing peer.

The peer here is a gRPC server on a port chosen at run time that answers every PutShard the
way a ReplicaReceiver at its MAX_TRANSFERS does; the sender is a real PeerLink and Replication.
"""

from __future__ import annotations

import asyncio
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta
from ckpt_core.shard_key import ShardKey

from ckptd.cluster.peer_link import PeerLink
from ckptd.config import PeerConfig
from ckptd.errors import PeerBusy
from ckptd.replication.sending import Replication

BUSY = "rank 0/1 shard of j step 1: 32 replicas are being received already"


def _busy_receiver() -> tuple[grpc.Server, int]:
    def put_shard(pieces, context):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)

    handlers = {"PutShard": grpc.stream_unary_rpc_method_handler(put_shard)}
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ckpt.wire.v1.CkptdPeer", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


# grpc's channel_ready_future (PeerLink.connect) leaves a thread polling the channel for up to 0.2 s after it is
# ready; a channel closed within that time makes it raise "Channel closed!" there. The daemon keeps its links open.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_busy_receiver_is_counted_busy_and_the_sender_neither_fails_it_nor_starts_its_failover_clock(tmp_path):
    server, port = _busy_receiver()
    link = PeerLink(f"127.0.0.1:{port}", PeerConfig(insecure=True, data_channel=False))
    source = tmp_path / "rank-00000.data"
    source.write_bytes(b"")
    key = ShardKey("j", 1, 0, 1)
    meta = ShardMeta(key.job, key.step, key.rank, key.world_size, 0, CHUNK_SIZE_BYTES, (), "{}")

    async def one_attempt() -> Replication:
        attempted = asyncio.Event()
        threads = futures.ThreadPoolExecutor(2)
        replication = Replication([link], 1, lambda k, done: attempted.set(), threads, threads, failover_s=0.0)
        replication.track(key, meta, [Path(source)])
        replication.retry_now(key)
        await asyncio.wait_for(attempted.wait(), 30)
        await replication.drain()
        threads.shutdown()
        return replication

    try:
        replication = asyncio.run(one_attempt())
        busy = pytest.raises(PeerBusy, match="32 replicas are being received already")
        with futures.ThreadPoolExecutor(1) as streams, busy:
            link.put_shard(meta, source, streams)
    finally:
        server.stop(None)
        link.close()

    assert replication.counters["replicas_busy"] == 1
    assert replication.counters["replica_failures"] == 0
    peer = replication.peers_status()[link.address]
    assert peer["consecutive_failures"] == 0 and "busy" in str(peer["last_error"]), peer
    assert not replication.state(key)[0], "not replicated: it is sent again after a pause"
