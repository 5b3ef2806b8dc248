"""A step a peer says is complete is sealed here once; told again it changes nothing, told otherwise it is refused."""

from __future__ import annotations

import asyncio
import mmap
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta, digest

from ckptd.config import Config
from ckptd.errors import StepAlreadyComplete
from ckptd.replication.peering import Peering
from ckptd.tiers.nvme import LocalDirTier


def test_a_commit_told_again_changes_nothing_and_another_one_is_refused(tmp_path):
    nvme, replicas = LocalDirTier(tmp_path / "nvme"), LocalDirTier(tmp_path / "replicas", name="peer")
    meta = ShardMeta("j", 1, 0, 1, 4096, CHUNK_SIZE_BYTES, (), "{}")
    meta = nvme.write_shard(meta, memoryview(mmap.mmap(-1, 4096)))  # here, its step not yet sealed on this node
    record = CommitRecord("j", 1, 1, (digest(meta.to_bytes()),), 4096)
    other = CommitRecord("j", 1, 1, (digest(b"another shard"),), 4096)
    with ThreadPoolExecutor(2) as threads:
        peering = Peering(Config(), None, nvme, replicas, None, None, "instance", threads)
        assert asyncio.run(peering.adopt_told(record)) is True  # sealed just now: worth a line in the log
        assert asyncio.run(peering.adopt_told(record)) is False  # told again (or by a peer that repeats itself)
        with pytest.raises(StepAlreadyComplete, match="another commit record; kept"):
            asyncio.run(peering.adopt_told(other))
    assert nvme.checked_commit("j", 1) == record and nvme.has_shard("j", 1, 0)
