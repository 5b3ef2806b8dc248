"""Saves that outrun the disk: the newest snapshot wins, ranks flush the same steps, flush_every keeps its steps.

Each test runs a whole node (the composition root, every role) in this process on real files, with the NVMe
writes held at a gate (a threading.Event) so that what the disk is busy with, and what
waits meanwhile, is decided by the test, not by the machine's speed.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from ckpt_core.shard_key import ShardKey

from ckptd.config import Config, NodeConfig, NvmeConfig, StagingConfig
from ckptd.node import Executors, Node
from ckptd.save.passed_over import PassedOver
from ckptd.save.staging import SlotPool, Snapshot

MIB = 1 << 20
MEMORY_THREADS = ThreadPoolExecutor(4, thread_name_prefix="slot-memory")  # every SlotPool here allocates on it
GATE_TIMEOUT_S = 60.0


class GatedDisk:
    """Hold every NVMe write of a node until opened; note each shard as its write starts and ends."""

    def __init__(self, node: Node) -> None:
        self.real = node.nvme.write_shard
        self.opened = threading.Event()
        self.started: queue.Queue[tuple[int, int]] = queue.Queue()  # (step, rank) as each write begins
        self.written: list[tuple[int, int]] = []
        node.nvme.write_shard = self.write_shard  # type: ignore[method-assign]

    def write_shard(self, meta, data, on_hashed=None):
        self.started.put((meta.step, meta.rank))
        assert self.opened.wait(GATE_TIMEOUT_S), "the test never opened the gate"
        written = self.real(meta, data, on_hashed=on_hashed)
        self.written.append((meta.step, meta.rank))
        return written

    async def writing(self) -> tuple[int, int]:
        """Return the next shard whose write began (waiting for it off the event loop)."""
        return await asyncio.to_thread(self.started.get, True, GATE_TIMEOUT_S)


def _config(tmp_path, flush_every=0, policy="block", budget_bytes=0):
    return Config(
        node=NodeConfig(root=str(tmp_path / "nvme")),
        staging=StagingConfig(dir=str(tmp_path / "shm"), policy=policy, budget_bytes=budget_bytes),
        nvme=NvmeConfig(flush_every=flush_every),
    )


def _payload(step: int, rank: int, size: int = MIB) -> bytes:
    return bytes([(step * 7 + rank) % 251]) * size


async def _reserve(node: Node, key: ShardKey, size: int = MIB):
    return await node.save_path.reserve(key, size)


async def _commit(node: Node, key: ShardKey, slot, size: int = MIB) -> None:
    with open(slot.path, "r+b") as f:
        f.write(_payload(key.step, key.rank, size))
    await node.save_path.commit(Snapshot(key, str(slot.path), slot.reservation, size, "{}"))


async def _save(node: Node, job: str, step: int, ranks=(0,), world_size=1):
    """Save a step on every rank at once, as ranks do: all reserve, all copy, all commit; return the reservations."""
    keys = [ShardKey(job, step, rank, world_size) for rank in ranks]
    reserved = await asyncio.gather(*(_reserve(node, key) for key in keys))
    for key, (slot, _, _) in zip(keys, reserved, strict=True):
        if slot is not None:
            await _commit(node, key, slot)
    return reserved


async def _wait(node: Node, job: str, step: int, rank=0, world_size=1, tier="nvme"):
    return await node.save_path.wait_shard(ShardKey(job, step, rank, world_size), tier, GATE_TIMEOUT_S)


def _run(config, body):
    async def run():
        node = Node(config, Executors.build())
        disk = GatedDisk(node)  # before start(): the flushes a restart resumes are held too
        await node.start()
        try:
            return await body(node, disk)
        finally:
            disk.opened.set()
            await node.drain()

    return asyncio.run(run())


def test_saves_never_wait_for_the_disk_and_the_newest_snapshot_is_flushed_next(tmp_path):
    async def body(node, disk):
        await _save(node, "j", 1)
        assert await disk.writing() == (1, 0)  # the disk is busy with step 1 from now on
        for step in (2, 3, 4, 5):
            [(slot, blocked_s, reason)] = await _save(node, "j", step)
            assert slot is not None and blocked_s == 0 and reason == ""  # never a wait for the disk
        for step in (2, 3, 4):  # each replaced by the next save before the disk was free for it
            answer = await _wait(node, "j", step)
            assert answer.passed_over and not answer.done
            assert f"j step {step} rank 0 was passed over" in answer.error
            assert f"(step {step + 1})" in answer.error
            assert (await _wait(node, "j", step, tier="memory")).done  # it was in memory all the same
        disk.opened.set()
        assert (await _wait(node, "j", 5)).done
        assert (await _wait(node, "j", 1)).done
        assert disk.written == [(1, 0), (5, 0)]  # step 5, the newest, right after step 1: nothing in between
        assert node.nvme.complete_steps("j") == [1, 5]
        status = await node.report.document()
        assert status["passed_over"] == {"j": {"steps": 3, "last_step": 4, "replaced_by": 5}}
        assert status["counters"]["passed_over"] == 3

    _run(_config(tmp_path), body)


def test_the_ranks_of_a_job_flush_the_same_steps_in_rounds(tmp_path):
    ranks = range(4)

    async def body(node, disk):
        await _save(node, "r", 1, ranks, 4)
        first = {await disk.writing(), await disk.writing()}  # two flush threads, four shards of step 1
        assert {step for step, _ in first} == {1}
        for step in (2, 3, 4):
            for slot, blocked_s, reason in await _save(node, "r", step, ranks, 4):
                assert slot is not None and blocked_s == 0 and "NVMe" not in reason
        # Rank 0 alone saves step 5 and its others have not yet: the ranks disagree (rank 0 replaced step 4).
        await _save(node, "r", 5, [0], 4)
        disk.opened.set()
        await _save(node, "r", 5, [1, 2, 3], 4)
        for rank in ranks:
            assert (await _wait(node, "r", 5, rank, 4)).done
            for step in (2, 3, 4):
                assert (await _wait(node, "r", step, rank, 4)).passed_over
        assert sorted(disk.written) == [(step, rank) for step in (1, 5) for rank in ranks]  # every rank the same steps
        assert node.nvme.complete_steps("r") == [1, 5]
        assert (await node.report.document())["passed_over"]["r"]["steps"] == 3  # steps, not shards

    _run(_config(tmp_path), body)


def test_flush_every_keeps_its_steps_and_a_save_that_needs_their_slot_waits_or_is_skipped(tmp_path):
    async def body(node, disk):
        await _save(node, "k", 1)
        assert await disk.writing() == (1, 0)
        await _save(node, "k", 2)
        [(slot, _, _)] = await _save(node, "k", 3)  # replaces step 2, which flush_every = 3 does not keep
        assert slot is not None
        [(slot, blocked_s, reason)] = await _save(node, "k", 4)  # step 1 on the disk, step 3 kept
        assert slot is None and blocked_s == 0
        assert "waits for the NVMe flush of k step 1" in reason and "step 3 is kept by [nvme] flush_every = 3" in reason
        assert "staging.policy = skip" in reason
        disk.opened.set()
        assert (await _wait(node, "k", 3)).done
        assert (await _wait(node, "k", 2)).passed_over
        assert disk.written == [(1, 0), (3, 0)]
        assert (await node.report.document())["counters"]["skipped"] == 1

    _run(_config(tmp_path, flush_every=3, policy="skip"), body)


def test_under_block_a_save_waits_for_the_flush_of_a_kept_step_and_says_so(tmp_path):
    async def body(node, disk):
        await _save(node, "b", 1)
        assert await disk.writing() == (1, 0)
        await _save(node, "b", 2)  # kept (flush_every = 1: every step, as before)
        pool = node.pool
        blocked = asyncio.ensure_future(_save(node, "b", 3))
        while not pool._changed._waiters:  # until the save waits for a slot
            await asyncio.sleep(0.01)
        assert not blocked.done()
        disk.opened.set()
        [(slot, blocked_s, reason)] = await blocked
        assert slot is not None and blocked_s > 0
        assert reason.startswith("waits for the NVMe flush of b step 1")
        for step in (1, 2, 3):
            assert (await _wait(node, "b", step)).done
        assert sorted(disk.written) == [(1, 0), (2, 0), (3, 0)]
        assert (await node.report.document())["passed_over"] == {}

    _run(_config(tmp_path, flush_every=1), body)


def test_a_restart_flushes_only_the_newest_pending_snapshot_and_passes_over_the_older(tmp_path):
    config = _config(tmp_path)
    # A daemon that died with steps 5 and 6 of both ranks committed and nothing flushed.
    pool = SlotPool(config.staging_dir, 0, "block", memory_threads=MEMORY_THREADS)
    pool.recover()

    async def commit_both():
        for step in (5, 6):
            for rank in (0, 1):
                slot = (await pool.reserve("c", rank, MIB)).slot
                with open(slot.path, "r+b") as f:
                    f.write(_payload(step, rank))
                pool.commit(Snapshot(ShardKey("c", step, rank, 2), str(slot.path), slot.reservation, MIB, "{}"))

    asyncio.run(commit_both())
    markers = sorted(p.name for p in (config.staging_dir / "c").glob("*.pending.json"))
    assert len(markers) == 4

    async def body(node, disk):
        for rank in (0, 1):
            assert (await _wait(node, "c", 6, rank, 2)).done
            assert (await _wait(node, "c", 5, rank, 2)).passed_over
        assert sorted(disk.written) == [(6, 0), (6, 1)]  # step 5 was never written
        assert node.nvme.complete_steps("c") == [6]
        assert not (config.root / "c" / "5").exists()
        held = {s.shard.step for s in node.pool.slots() if s.shard}
        assert held == {6}  # step 5's markers are gone: a second restart would not find it either

    async def opened(node, disk):
        disk.opened.set()
        return await body(node, disk)

    _run(config, opened)


def test_prepare_allocates_the_rank_slots_ahead_once_and_the_first_save_takes_one(tmp_path):
    pool = SlotPool(tmp_path / "staging", 0, "block", memory_threads=MEMORY_THREADS)
    pool.recover()

    async def run():
        free = await pool.prepare("p", 0, 3 * MIB - 5)
        assert [s.size_bytes for s in free] == [3 * MIB, 3 * MIB]  # both slots, rounded up as reserve does
        assert all(s.state == "free" and s.reservation == 0 and s.path.stat().st_size == 3 * MIB for s in free)
        inodes = {s.path.stat().st_ino for s in free}
        again = await pool.prepare("p", 0, 3 * MIB - 5)
        assert [s.path for s in again] == [s.path for s in free] and len(pool.slots()) == 2  # nothing new
        assert {s.path.stat().st_ino for s in again} == inodes
        reserved = await pool.reserve("p", 0, 3 * MIB)
        assert reserved.slot in free and reserved.reason == "" and reserved.blocked_s == 0
        assert len(pool.slots()) == 2

    asyncio.run(run())


def test_prepare_of_a_restarted_rank_also_names_the_slot_of_its_newest_snapshot_after_the_free_one(tmp_path):
    pool = SlotPool(tmp_path / "staging", 0, "block", memory_threads=MEMORY_THREADS)
    pool.recover()

    async def run():
        slot = (await pool.reserve("p", 0, 2 * MIB)).slot
        pool.commit(Snapshot(ShardKey("p", 1, 0, 1), str(slot.path), slot.reservation, MIB, "{}"))
        named = await pool.prepare("p", 0, 2 * MIB)  # the trainer restarted: its memory tier holds step 1
        assert [s.state for s in named] == ["free", slot.state] and named[-1] is slot
        assert pool.newest("p", 0) is slot and slot.shard == ShardKey("p", 1, 0, 1)  # untouched

    asyncio.run(run())


def test_prepare_keeps_within_the_budget_and_never_evicts_a_snapshot_being_flushed(tmp_path):
    pool = SlotPool(tmp_path / "staging", 3 * MIB, "skip", memory_threads=MEMORY_THREADS)
    pool.recover()

    async def run():
        slot = (await pool.reserve("other", 0, 2 * MIB)).slot
        pool.commit(Snapshot(ShardKey("other", 1, 0, 1), str(slot.path), slot.reservation, MIB, "{}"))
        pool.start_flush(slot)  # its job's round is writing it to NVMe
        assert await pool.prepare("p", 0, 2 * MIB) == []  # no room: nothing taken from the flush
        assert slot.state == "flushing" and slot.path.exists() and slot.pending_path.exists()
        assert [s.size_bytes for s in await pool.prepare("q", 0, MIB)] == [MIB]  # one slot fits the budget

    asyncio.run(run())


def test_what_was_passed_over_is_bounded():
    record = PassedOver(remembered_shards=8, max_jobs=3)
    for job in range(5):
        for step in range(50):
            record.passed_over(ShardKey(f"j{job}", step, 0, 1), step + 1)
    assert len(record._shards) == 8 and len(record._steps) == 8
    assert list(record.by_job()) == ["j2", "j3", "j4"]  # the jobs passed over most recently
    assert record.why(ShardKey("j4", 49, 0, 1)) is not None and record.why(ShardKey("j0", 1, 0, 1)) is None
