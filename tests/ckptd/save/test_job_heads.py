"""A Reserve places its save on the job's head without reading every complete step's commit record: the head is kept
per job (JobHeads), listed once, and follows each seal, adoption and removal."""

from __future__ import annotations

import asyncio
import mmap
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta
from ckpt_core.shard_key import ShardKey

from ckptd.save.flush import Flusher
from ckptd.save.progress import ShardProgress
from ckptd.save.save_path import SavePath
from ckptd.save.staging import SlotPool
from ckptd.tiers.nvme import LocalDirTier

STEPS = 50
RESERVES = 20


class CountedTier(LocalDirTier):
    """An NVMe tier that counts the commit records it is asked for (one stat each, at the least)."""

    reads = 0

    def checked_commit(self, job: str, step: int) -> CommitRecord | None:
        CountedTier.reads += 1
        return super().checked_commit(job, step)


def shard(step: int) -> tuple[ShardMeta, memoryview]:
    return ShardMeta("j", step, 0, 1, 4096, CHUNK_SIZE_BYTES, (), "{}"), memoryview(mmap.mmap(-1, 4096))


@pytest.fixture
def saves(tmp_path):
    """Yield (a save path over NVMe with steps 1..STEPS complete, the NVMe tier, step STEPS + 1's record elsewhere)."""
    nvme = CountedTier(tmp_path / "nvme")
    for step in range(1, STEPS + 1):
        nvme.write_shard(*shard(step))
        assert nvme.try_commit("j", step, 1) is not None
    nvme.write_shard(*shard(STEPS + 1))  # its shard is here, its commit notice was missed
    elsewhere = LocalDirTier(tmp_path / "elsewhere")
    elsewhere.write_shard(*shard(STEPS + 1))
    record = elsewhere.try_commit("j", STEPS + 1, 1)
    assert record is not None
    committed: list[CommitRecord] = []  # what the cluster view knows committed
    view = SimpleNamespace(
        commit_record=lambda job, step: record if step == STEPS + 1 else None, committed=lambda job: committed
    )
    with ThreadPoolExecutor(2) as threads, ThreadPoolExecutor(1) as removal_thread:
        pool = SlotPool(tmp_path / "staging", 0, "block", memory_threads=threads)
        store = LocalDirTier(tmp_path / "replicas", "peer")
        path = SavePath(
            pool, Flusher(pool, nvme, threads), nvme, store, [nvme, store], SimpleNamespace(), None,
            ShardProgress(pool, nvme, None, None, "n", threads), None, view, threads, threads, removal_thread,
            threads, None, None,
        )  # type: ignore[arg-type]  # fmt: skip
        yield path, nvme, record


def placed(saves: SavePath, step: int) -> bool:
    """Say whether a save of step with no line asked (the job's head continued) is placed, or refused as older."""
    try:
        asyncio.run(saves.line_for(ShardKey("j", step, 0, 1), None, -1))
    except InvalidArgument:
        return False
    return True


def test_a_reserve_reads_no_commit_record_once_the_jobs_head_is_known(saves):
    path = saves[0]
    CountedTier.reads = 0
    for step in range(STEPS + 1, STEPS + 1 + RESERVES):
        assert placed(path, step)
    # The first Reserve lists the job once (STEPS records); each later one reads none (it read them all before).
    assert CountedTier.reads <= STEPS + 1, f"{CountedTier.reads} commit records read by {RESERVES} Reserves"


def test_the_kept_head_follows_an_adoption_and_the_heads_removal(saves):
    path, nvme, record = saves
    assert not placed(path, STEPS - 1) and placed(path, STEPS)  # the head is STEPS
    asyncio.run(path.adopt_missed_commits(nvme, "j"))  # STEPS + 1 sealed here with the cluster's record
    assert nvme.checked_commit("j", STEPS + 1) == record
    assert not placed(path, STEPS) and placed(path, STEPS + 1)
    asyncio.run(path.release(nvme, "j", STEPS + 1, None))
    asyncio.run(path.release(nvme, "j", STEPS, None))
    assert placed(path, STEPS - 1)  # the head is STEPS - 1 again
