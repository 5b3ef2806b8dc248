"""Staging slots: which slot a save gets, who may commit it, and what survives a restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ckpt_core.errors import InvalidArgument, ReservationLost
from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta
from ckpt_core.shard_key import ShardKey

from ckptd.save.staging import DEFAULT_BUDGET_SHARE, SlotPool, Snapshot, default_budget_bytes

MIB = 1 << 20
MEMORY_THREADS = ThreadPoolExecutor(4, thread_name_prefix="slot-memory")  # every SlotPool here allocates on it


def _pool(tmp_path, budget_bytes=0, policy="block"):
    pool = SlotPool(tmp_path / "staging", budget_bytes, policy, memory_threads=MEMORY_THREADS)
    pool.recover()
    return pool


def _save(pool, step, size=MIB, job="j", rank=0):
    """Reserve, commit and checksum a slot as a save would, and settle it as a finished flush would."""

    async def run():
        slot = (await pool.reserve(job, rank, size)).slot
        key = ShardKey(job, step, rank, 1)
        pool.commit(Snapshot(key, str(slot.path), slot.reservation, size, "{}"))
        pool.record_hashed(slot, ShardMeta(job, step, rank, 1, size, CHUNK_SIZE_BYTES, ("0" * 32,), "{}"))
        await pool.settle(slot)
        return slot

    return asyncio.run(run())


def test_the_newest_snapshot_keeps_its_slot_while_a_spare_one_exists(tmp_path):
    pool = _pool(tmp_path)
    first = _save(pool, 1)
    second = _save(pool, 2)
    assert second is not first and first.shard.step == 1
    third = _save(pool, 3)
    assert third is first  # the older of the two is reused, the newest (step 2) stays in memory
    assert pool.newest("j", 0) is third and second.shard.step == 2


def test_a_reservation_taken_over_cannot_commit(tmp_path):
    pool = _pool(tmp_path)

    async def run():
        old = (await pool.reserve("j", 0, MIB)).slot
        stale = old.reservation
        new = (await pool.reserve("j", 0, MIB)).slot  # the first save died half-way; the rank saves again
        with pytest.raises(ReservationLost, match="no longer reserved"):
            pool.commit(Snapshot(ShardKey("j", 1, 0, 1), str(old.path), stale, MIB, "{}"))
        pool.commit(Snapshot(ShardKey("j", 1, 0, 1), str(new.path), new.reservation, MIB, "{}"))

    asyncio.run(run())


def test_a_slot_locked_by_a_live_writer_is_not_taken_over(tmp_path):
    pool = _pool(tmp_path)
    slot = asyncio.run(pool.reserve("j", 0, MIB)).slot
    # Another process is copying into the slot: it holds the writer lock, as the client does.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, os, sys; fd = os.open({str(slot.path)!r}, os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InvalidArgument, match="another live process"):
            asyncio.run(pool.reserve("j", 0, MIB))
    finally:
        holder.kill()
        holder.wait()
    again = asyncio.run(pool.reserve("j", 0, MIB)).slot  # the holder died: its half-done copy is abandoned
    assert again is not None


def test_skip_policy_answers_at_once_when_no_room_is_left(tmp_path):
    pool = _pool(tmp_path, budget_bytes=2 * MIB, policy="skip")

    async def run():
        await pool.reserve("other", 0, 2 * MIB)
        skipped = await pool.reserve("j", 0, MIB)
        assert skipped.slot is None and skipped.blocked_s == 0 and "budget" in skipped.reason
        with pytest.raises(InvalidArgument, match="cannot fit"):
            await pool.reserve("j", 0, 3 * MIB)

    asyncio.run(run())


def test_a_job_takes_no_more_than_its_share_and_other_jobs_save_on(tmp_path):
    # no budget: the job's share binds
    pool = SlotPool(tmp_path / "staging", 0, "skip", job_budget_bytes=3 * MIB, memory_threads=MEMORY_THREADS)
    pool.recover()

    async def run():
        assert (await pool.reserve("greedy", 0, 2 * MIB)).slot is not None
        skipped = await pool.reserve("greedy", 1, 2 * MIB)  # its rank 0 holds 2 of its 3 MiB
        assert skipped.slot is None and "greedy's share, staging.job_budget_bytes (3145728)" in skipped.reason
        assert (await pool.reserve("other", 0, 2 * MIB)).slot is not None  # another job is not held up
        with pytest.raises(InvalidArgument, match=r"cannot fit in staging\.job_budget_bytes = 3145728"):
            await pool.reserve("greedy", 0, 4 * MIB)

    asyncio.run(run())


def test_the_default_budget_is_a_share_of_the_staging_filesystem_measured_before_the_directory_exists(tmp_path):
    fs = os.statvfs(tmp_path)
    budget = default_budget_bytes(tmp_path / "not" / "made" / "yet")
    assert budget % MIB == 0
    assert fs.f_blocks * fs.f_frsize * DEFAULT_BUDGET_SHARE - MIB < budget <= fs.f_blocks * fs.f_frsize * 0.75


def test_with_no_budget_a_shard_larger_than_the_filesystem_is_refused_before_any_allocation(tmp_path):
    pool = _pool(tmp_path, budget_bytes=0)
    with pytest.raises(InvalidArgument, match=r"cannot fit in .* bytes\)"):
        asyncio.run(pool.reserve("j", 0, 1 << 50))  # a hostile size: nothing is allocated for it
    assert not list(tmp_path.rglob("rank-*"))


def test_a_restarted_pool_finds_what_each_slot_holds(tmp_path):
    pool = _pool(tmp_path)
    _save(pool, 4)

    async def pending():
        slot = (await pool.reserve("j", 0, MIB)).slot
        pool.commit(Snapshot(ShardKey("j", 5, 0, 1), str(slot.path), slot.reservation, MIB, '{"tensors": []}'))

    asyncio.run(pending())
    again = _pool(tmp_path)
    held = {s.shard.step: s for s in again.slots() if s.shard}
    assert set(held) == {4, 5}
    assert held[4].meta is not None  # checksummed: servable from memory
    assert held[5].meta is None and held[5].layout_json == '{"tensors": []}'  # still to be checksummed and flushed


def test_the_first_save_of_a_rank_allocates_its_second_slot_too(tmp_path):
    pool = _pool(tmp_path)
    first = _save(pool, 1, size=2 * MIB)
    spare = pool.spare("j", 0)
    assert spare is not None and spare is not first and spare.size_bytes == 2 * MIB
    assert spare.path.stat().st_size == 2 * MIB
    assert _save(pool, 2, size=2 * MIB) is spare  # the next save gets the slot the client mapped ahead
    assert pool.spare("j", 0) is None


def test_no_spare_slot_beyond_the_budget(tmp_path):
    pool = _pool(tmp_path, budget_bytes=3 * MIB)
    _save(pool, 1, size=2 * MIB)
    assert pool.spare("j", 0) is None


@pytest.fixture
def shm_dir():
    """Yield a directory in shared memory, where allocating really takes time (as in production)."""
    path = Path("/dev/shm") / f"ckpt-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_one_rank_allocating_a_large_slot_does_not_hold_up_another(shm_dir):
    pool = SlotPool(shm_dir, 0, "block", memory_threads=MEMORY_THREADS)
    pool.recover()
    finished: list[str] = []

    async def reserve(job, size):
        await pool.reserve(job, 0, size)
        finished.append(job)

    async def run():
        big = asyncio.create_task(reserve("big", 1 << 30))  # 1 GiB, twice (slot and spare): a while
        await asyncio.sleep(0)  # let it take the pool and start allocating
        await reserve("small", MIB)
        assert not big.done()
        await big

    asyncio.run(run())
    assert finished == ["small", "big"]
    assert pool.in_use_bytes() == 2 * (1 << 30) + 2 * MIB


def test_the_order_of_commits_survives_a_restart(tmp_path):
    pool = _pool(tmp_path)
    first = _save(pool, 1)
    second = _save(pool, 2)
    assert 0 < first.committed_seq < second.committed_seq
    again = {s.shard.step: s for s in _pool(tmp_path).slots() if s.shard}
    assert again[1].committed_seq == first.committed_seq and again[2].committed_seq == second.committed_seq


def test_a_client_commits_only_the_slot_it_reserved(tmp_path):
    pool = _pool(tmp_path)

    async def run():
        mine = (await pool.reserve("j", 0, MIB)).slot
        other = (await pool.reserve("k", 0, MIB)).slot
        with pytest.raises(InvalidArgument, match="is not a staging slot of this rank"):  # another rank's slot
            pool.commit(Snapshot(ShardKey("j", 1, 1, 2), str(mine.path), mine.reservation, MIB, "{}"))
        with pytest.raises(InvalidArgument, match="is not a staging slot of this rank"):  # another job's
            pool.commit(Snapshot(ShardKey("j", 1, 0, 2), str(other.path), other.reservation, MIB, "{}"))
        with pytest.raises(InvalidArgument, match="is not a staging slot of this rank"):  # not a slot at all
            pool.commit(Snapshot(ShardKey("j", 1, 0, 2), str(tmp_path / "elsewhere"), mine.reservation, MIB, "{}"))
        with pytest.raises(ReservationLost, match="no longer reserved"):  # a guessed reservation
            pool.commit(Snapshot(ShardKey("j", 1, 0, 2), str(mine.path), mine.reservation + 1, MIB, "{}"))
        pool.commit(Snapshot(ShardKey("j", 1, 0, 2), str(mine.path), mine.reservation, MIB, "{}"))

    asyncio.run(run())


def test_slots_found_at_start_count_against_the_budget(tmp_path):
    _save(_pool(tmp_path), 1, job="before")  # a daemon that stopped, leaving its newest snapshot in memory
    slots = [p for p in (tmp_path / "staging" / "before").iterdir() if p.suffix.startswith(".slot-")]
    on_disk = sum(p.stat().st_size for p in slots)
    pool = _pool(tmp_path, budget_bytes=on_disk, policy="skip")  # starts by finding them
    assert pool.in_use_bytes() == on_disk > 0

    async def run():
        reserved = await pool.reserve("after", 0, on_disk)
        assert reserved.slot is None and "budget" in reserved.reason  # the other job's newest snapshot is never evicted

    asyncio.run(run())


def test_markers_left_without_their_slot_or_half_written_are_removed_at_start(tmp_path):
    _save(_pool(tmp_path), 1)
    job_dir = tmp_path / "staging" / "j"
    (job_dir / "rank-00003.slot-0.meta.json").write_text("{}")  # its slot is gone
    (job_dir / "rank-00000.slot-0.pending.json.tmp").write_text("half")  # a crash in write_replace
    (job_dir / "notes.txt").write_text("not ours to judge")
    kept = sorted(
        p.name for p in job_dir.iterdir() if not p.name.startswith(("rank-00003", "rank-00000.slot-0.pending.json.tmp"))
    )
    pool = _pool(tmp_path)
    assert sorted(p.name for p in job_dir.iterdir()) == kept
    assert pool.newest("j", 0) is not None and pool.newest("j", 0).shard.step == 1
