"""The retention runner on real step directories: passes follow the job's line and its pins; rm refuses what it must."""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from ckpt_core.byte_range import ByteRange
from ckpt_core.chunks import chunk_digests
from ckpt_core.errors import NotFound
from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta

from ckptd.config import Config, NodeConfig, RetentionConfig
from ckptd.errors import RemovalRefused
from ckptd.keyed import SharedLocks
from ckptd.operations.job_retention import JobRetention
from ckptd.operations.retention import RetentionRunner
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.replica_store import ReplicaStore


async def no_missed_commits(tier, job):
    """The save path's adopt_missed_commits where no cluster view is: nothing to adopt."""


async def release(tier, job, step, listed):
    """The save path's release, played here: the step leaves the tier."""
    tier.remove_step(job, step, listed)


async def no_slots(job, step, dry_run):
    """The save path's release_slots where no staging slot holds the step."""
    return []


class Holder:
    """A role that holds steps (BusySteps)."""

    def __init__(self) -> None:
        self.held: set[tuple[str, int]] = set()

    def busy_steps(self) -> set[tuple[str, int]]:
        return set(self.held)


def seal_step(tier, step, line=()):
    meta = ShardMeta("j", step, 0, 1, 4096, CHUNK_SIZE_BYTES, (), "{}", line=line)
    tier.write_shard(meta, memoryview(mmap.mmap(-1, 4096)))
    assert tier.try_commit("j", step, 1) is not None


@pytest.fixture
def node(tmp_path):
    """Yield (runner, the NVMe tier, the busy holder): steps 1..4 of the first line, then 5 and 6 forked at 2."""
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), retention=RetentionConfig(nvme=2, peer=2))
    nvme, replicas = LocalDirTier(config.root), ReplicaStore(config.replica_root)
    for step in (1, 2, 3, 4):
        seal_step(nvme, step)
    for step in (5, 6):
        seal_step(nvme, step, line=((2, 1),))  # a rollback to step 2: 3 and 4 are superseded, 6 is the head
    holder = Holder()
    with ThreadPoolExecutor(2) as threads:
        jobs = JobRetention(config, threads)
        runner = RetentionRunner(
            *(config, [nvme, replicas], None, no_missed_commits, release, no_slots, [holder], threads, threads, jobs),
            steps_in_use,
        )
        yield runner, nvme, holder


steps_in_use: SharedLocks[tuple[str, int]] = SharedLocks()  # the fixture's runner's, held by "loads" below


def steps_on(tier):
    return tier.all_steps("j")


def test_a_pass_removes_the_superseded_steps_first_and_keeps_the_lines_newest_and_the_pins(node):
    runner, nvme, _ = node
    asyncio.run(runner.pin("j", 3, True))
    removals = asyncio.run(runner.retain("sealed", "j"))
    assert [(r.step, r.reason.split(":")[0]) for r in removals] == [
        (4, "superseded"),
        (1, "older than the newest 2 complete steps"),
        (2, "older than the newest 2 complete steps"),
    ]
    assert steps_on(nvme) == [3, 5, 6]  # the line's newest 2, and the pinned superseded step


def test_a_step_a_load_is_locating_stays_though_the_pass_planned_its_removal(node):
    # A load's locate holds its step shared (Locator) from the moment it knows the step until it answers,
    # and leases it for reading only on the way: a removal must pass over a step held so, without waiting
    # for the load. Before, retention checked busy, then waited for the seal lock and removed a step a load
    # had meanwhile fetched onto NVMe ("has no rank 0 ... (world_size 0)" in the chaos campaign).
    runner, nvme, _ = node

    async def body() -> list[int]:
        async with steps_in_use.shared(("j", 1)):  # a locate of step 1 under way, its lease not yet taken
            return [r.step for r in await asyncio.wait_for(runner.retain("sealed", "j"), 30)]

    assert asyncio.run(body()) == [3, 4, 2]
    assert steps_on(nvme) == [1, 5, 6]
    assert [r.step for r in asyncio.run(runner.retain("sealed", "j"))] == [1]  # once the load is gone


def test_a_superseded_step_that_a_rollbacks_line_began_saving_again_since_the_listing_stays_with_its_new_shard(
    tmp_path,
):
    # Lightning's own test_restarting_mid_epoch_raises_warning, one run in three: a rollback's line saved step
    # 8 again, whose seal started a pass that listed the old line's step 16 as superseded; the new line's
    # step 16 began its flush before the removal (its slot was still being filled when the pass asked who was
    # busy), and the removal took the new shard's directory with the old step: "rank 0 shard of ... step 16
    # on tier nvme: No such file or directory". The removal must be of the step as the pass listed it.
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), retention=RetentionConfig(nvme=3))
    nvme = LocalDirTier(config.root)
    for step in (4, 8, 16):
        seal_step(nvme, step)
    seal_step(nvme, 8, line=((4, 1),))  # the rollback to step 4 saved step 8 again: the old 16 is superseded
    new_line = ((4, 1),)
    meta = ShardMeta("j", 16, 0, 1, 4096, CHUNK_SIZE_BYTES, (), "{}", line=new_line)
    flushes = []

    async def release_as_a_flush_begins(tier, job, step, listed=None):
        if step == 16 and not flushes:
            flushes.append(nvme.open_shard(meta))  # the new line's step 16: the old one retired, its copy begun
        tier.remove_step(job, step, listed)

    with ThreadPoolExecutor(2) as threads:
        runner = RetentionRunner(
            *(config, [nvme], None, no_missed_commits, release_as_a_flush_begins, no_slots, [], threads, threads),
            JobRetention(config, threads),
            SharedLocks(),
        )
        assert [r.step for r in asyncio.run(runner.retain("sealed", "j"))] == []  # 16 was the pass's one removal
    data = memoryview(mmap.mmap(-1, 4096))
    digests = chunk_digests(data, CHUNK_SIZE_BYTES)
    flushes[0].write(ByteRange(0, 4096), data, digests)
    flushes[0].seal(dataclasses.replace(meta, chunk_xxh3_128=tuple(digests)))  # the flush goes on, undisturbed
    assert nvme.try_commit("j", 16, 1).line == new_line
    assert nvme.complete_lines("j") == {4: (), 8: new_line, 16: new_line}


def test_a_step_held_alone_is_not_taken_alone_again_and_a_shared_holder_waits_for_it():
    locks: SharedLocks[str] = SharedLocks()
    order: list[str] = []

    async def locate() -> None:
        async with locks.shared("s"):
            order.append("located")

    async def body() -> None:
        async with locks.alone_if_free("s") as free:
            assert free
            waiting = asyncio.ensure_future(locate())
            await asyncio.sleep(0)
            async with locks.alone_if_free("s") as again:
                assert not again
            order.append("removed")
        await waiting
        async with locks.shared("s"), locks.shared("s"), locks.alone_if_free("s") as free:
            assert not free  # held shared (twice: a nested hold never waits on itself)
        assert len(locks) == 0

    asyncio.run(body())
    assert order == ["removed", "located"]


def test_rm_refuses_the_head_a_busy_step_and_a_pinned_one_and_names_the_steps_for_a_missing_one(node):
    runner, nvme, holder = node
    with pytest.raises(RemovalRefused, match=r"j step 6 is the job's head .* pass --force"):
        asyncio.run(runner.remove_one("j", 6, force=False, dry_run=False))
    holder.held = {("j", 5)}
    with pytest.raises(RemovalRefused, match=r"j step 5 is in use on this node .* try again later"):
        asyncio.run(runner.remove_one("j", 5, force=True, dry_run=False))  # --force never overrides a busy step
    asyncio.run(runner.pin("j", 1, True))
    with pytest.raises(RemovalRefused, match="j step 1 is pinned"):
        asyncio.run(runner.remove_one("j", 1, force=False, dry_run=False))
    with pytest.raises(NotFound, match=r"j step 9 is on no tier of this node; .*\(all 6\): 6, 5, 4, 3, 2, 1"):
        asyncio.run(runner.remove_one("j", 9, force=False, dry_run=False))
    with pytest.raises(NotFound, match=r"j step 9 is not complete on any tier of this node"):
        asyncio.run(runner.pin("j", 9, True))
    assert steps_on(nvme) == [1, 2, 3, 4, 5, 6]

    assert [r.step for r in asyncio.run(runner.remove_one("j", 3, force=False, dry_run=True))] == [3]
    assert steps_on(nvme) == [1, 2, 3, 4, 5, 6]
    asyncio.run(runner.remove_one("j", 3, force=False, dry_run=False))  # superseded: not the head
    removals = asyncio.run(runner.remove_one("j", 6, force=True, dry_run=False))
    assert [(r.tier, r.step, r.reason) for r in removals] == [
        ("nvme", 6, "removed by ckptd rm --force (the job's head)")
    ]
    asyncio.run(runner.remove_one("j", 1, force=True, dry_run=False))
    assert steps_on(nvme) == [2, 4, 5] and runner.job_retention.pinned("j") == frozenset()


def test_a_pass_on_nvme_is_not_held_up_by_a_pass_on_the_store_still_listing(tmp_path):
    # After a restart a pass on the store lists a long history there; NVMe's passes (after each flush, and
    # reconciliation's after each round) must go on meanwhile, or NVMe fills and failover waits.
    listing, released = threading.Event(), threading.Event()

    def complete_lines(job: str) -> dict:
        listing.set()
        released.wait()
        return {}

    store = SimpleNamespace(complete_lines=complete_lines, all_steps=lambda job, afresh=False: [], damaged_steps=list)
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), retention=RetentionConfig(nvme=2))
    nvme = LocalDirTier(config.root)
    for step in (1, 2, 3):
        seal_step(nvme, step)

    async def body() -> list[int]:
        store_pass = asyncio.ensure_future(runner.retain("uploaded", "j"))
        while not listing.is_set():
            await asyncio.sleep(0.01)
        removals = await asyncio.wait_for(runner.retain("sealed", "j"), 10)
        released.set()
        await store_pass
        return [r.step for r in removals]

    with ThreadPoolExecutor(2) as threads, ThreadPoolExecutor(1) as object_threads:
        jobs = JobRetention(config, threads)
        runner = RetentionRunner(
            config,
            [nvme],
            store,
            no_missed_commits,
            release,
            no_slots,
            [],
            object_threads,
            threads,
            jobs,  # type: ignore[arg-type]
            SharedLocks(),
        )
        try:
            removed = asyncio.run(body())
        finally:
            released.set()
    assert removed == [1] and steps_on(nvme) == [2, 3]
