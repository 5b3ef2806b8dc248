"""The node's answers that order several roles: removing a whole job waits for the replicas it is receiving."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import ShardMeta, chunk_ranges, digest

from ckptd.config import Config, NodeConfig, StagingConfig
from ckptd.node import Executors, Node

CHUNK = 1 << 20


def test_a_job_is_not_removed_under_a_replica_being_received(tmp_path):
    # Its files went under the writes, and the sender's SealShard failed with an OSError (INTERNAL).
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), staging=StagingConfig(dir=str(tmp_path / "shm")))
    data = os.urandom(2 * CHUNK)
    digests = tuple(digest(data[o : o + n]) for o, n in chunk_ranges(len(data), CHUNK))
    meta = ShardMeta("j", 3, 0, 1, len(data), CHUNK, digests, "{}")

    async def first_half() -> AsyncIterator[bytes]:
        yield data[:CHUNK]

    async def body(node: Node) -> None:
        await node.receiver.receive_range(meta, "ab" * 8, ByteRange(0, CHUNK), first_half())  # the other half to come
        with pytest.raises(InvalidArgument, match="still receiving replicas of steps \\[3\\]"):
            await node.job_removal.remove("j", dry_run=False, object_too=False)
        assert list(config.replica_root.glob("j/3/*.partial"))
        await node.drain()

    asyncio.run(body(Node(config, Executors.build())))
