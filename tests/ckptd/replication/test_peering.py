"""A step a peer says is complete is sealed here once; told again it changes nothing, told otherwise it is refused.

Peering tells whether the record is held already (or refuses another one); the save path, the one writer of
the tiers' catalogs, adopts it.
"""

from __future__ import annotations

import asyncio
import mmap

import pytest
from ckpt_core.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta, digest

from ckptd.config import Config, NodeConfig, StagingConfig
from ckptd.errors import StepAlreadyComplete
from ckptd.node import Executors, Node


def test_a_commit_told_again_changes_nothing_and_another_one_is_refused(tmp_path):
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), staging=StagingConfig(dir=str(tmp_path / "shm")))
    other = CommitRecord("j", 1, 1, (digest(b"another shard"),), 4096)

    async def body(node: Node) -> CommitRecord:
        meta = ShardMeta("j", 1, 0, 1, 4096, CHUNK_SIZE_BYTES, (), "{}")
        meta = node.nvme.write_shard(meta, memoryview(mmap.mmap(-1, 4096)))  # here, its step not yet sealed
        record = CommitRecord("j", 1, 1, (digest(meta.to_bytes()),), 4096)
        assert await node.peering.told_before(record) is False
        await node.save_path.adopt_commit(record)  # sealed just now
        assert await node.peering.told_before(record) is True  # told again (or by a peer that repeats itself)
        await node.save_path.adopt_commit(record)
        with pytest.raises(StepAlreadyComplete, match="another commit record; kept"):
            await node.save_path.adopt_commit(other)
        return record

    async def run() -> CommitRecord:
        node = Node(config, Executors.build())
        await node.start()
        try:
            record = await body(node)
            assert node.nvme.checked_commit("j", 1) == record and node.nvme.has_shard("j", 1, 0)
            return record
        finally:
            await node.drain()

    asyncio.run(run())
