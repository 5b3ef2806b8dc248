"""The newest complete step of each job on each tier, as ShardProgress learns it from the roles' reports."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.shard_key import ShardKey

from ckptd.save import progress
from ckptd.save.progress import Completion, NewestSteps, ShardProgress
from ckptd.save.staging import SlotPool
from ckptd.tiers.nvme import LocalDirTier

MEMORY_THREADS = ThreadPoolExecutor(4, thread_name_prefix="slot-memory")  # every SlotPool here allocates on it


@pytest.fixture
def shard_progress(tmp_path):
    nvme = LocalDirTier(tmp_path / "nvme")
    pool = SlotPool(tmp_path / "staging", 0, "block", memory_threads=MEMORY_THREADS)
    yield ShardProgress(pool, nvme, replication=None, uploader=None, node="n", threads=MEMORY_THREADS)


def steps(newest: NewestSteps) -> dict[str, dict[str, int]]:
    return {job: {tier: c.step for tier, c in tiers.items()} for job, tiers in newest.by_job().items()}


def test_an_older_step_completing_late_changes_nothing():
    newest = NewestSteps()
    newest.completed("j", "nvme", 5, 100.0)
    newest.completed("j", "nvme", 4, 200.0)  # a late seal of an older step
    newest.completed("j", "nvme", 5, 300.0)  # the same step again: it became complete at 100
    assert newest.by_job() == {"j": {"nvme": Completion(5, 100.0)}}
    newest.completed("j", "nvme", 6, 400.0)
    assert newest.by_job() == {"j": {"nvme": Completion(6, 400.0)}}


def test_jobs_are_bounded_the_one_longest_quiet_goes_first(monkeypatch):
    monkeypatch.setattr(progress, "MAX_JOBS_REPORTED", 3)
    newest = NewestSteps()
    for i, job in enumerate(["a", "b", "c"]):
        newest.completed(job, "nvme", 1, float(i))
    newest.completed("a", "nvme", 2, 10.0)  # a is active again
    newest.completed("d", "nvme", 1, 11.0)
    assert sorted(newest.by_job()) == ["a", "c", "d"]


def test_a_removed_job_is_forgotten_on_the_tiers_it_left():
    newest = NewestSteps()
    for tier in ("memory", "nvme", "object"):
        newest.completed("j", tier, 3, 1.0)
    newest.forget("j", ("memory", "nvme", "peer"))
    assert steps(newest) == {"j": {"object": 3}}
    newest.forget("j", ("object",))
    assert newest.by_job() == {}


def test_a_step_is_complete_in_memory_once_every_rank_committed_here(shard_progress):
    for rank in (0, 1):
        shard_progress.copy_committed(ShardKey("j", 7, rank, 3))
    assert steps(shard_progress.newest) == {}
    shard_progress.copy_committed(ShardKey("j", 7, 2, 3))
    assert steps(shard_progress.newest) == {"j": {"memory": 7}}


def test_a_node_holding_some_ranks_never_has_the_step_whole_in_memory(shard_progress):
    for rank in (4, 5, 6, 7):  # the other ranks save on other nodes
        shard_progress.copy_committed(ShardKey("j", 1, rank, 8))
    assert steps(shard_progress.newest) == {}


def test_a_step_is_complete_on_the_peer_tier_once_every_shard_saved_here_has_its_replicas(shard_progress):
    keys = [ShardKey("j", 9, rank, 8) for rank in (0, 1)]  # ranks 2-7 save on other nodes
    for key in keys:
        shard_progress.copy_committed(key)
    shard_progress.reached(keys[1], "peer")
    assert "peer" not in steps(shard_progress.newest).get("j", {})
    shard_progress.reached(keys[0], "peer")
    assert steps(shard_progress.newest)["j"]["peer"] == 9


def test_a_replica_finished_after_a_restart_counts_for_its_own_shard(shard_progress):
    shard_progress.reached(ShardKey("j", 4, 3, 8), "peer")  # its copy was committed before this daemon started
    assert steps(shard_progress.newest) == {"j": {"peer": 4}}


def test_reaching_nvme_is_not_a_complete_step_only_a_seal_is(shard_progress):
    key = ShardKey("j", 2, 0, 2)
    shard_progress.copy_committed(key)
    shard_progress.sealing_started(key)
    shard_progress.sealing_done(key)  # the seal was tried; rank 1 is not in yet
    assert "nvme" not in steps(shard_progress.newest).get("j", {})
    shard_progress.step_completed("nvme", "j", 2, 123.0)
    assert shard_progress.newest.by_job()["j"]["nvme"] == Completion(2, 123.0)


def test_the_ranks_saved_here_are_remembered_for_the_newest_steps_only(shard_progress, monkeypatch):
    monkeypatch.setattr(progress, "REMEMBERED_SHARDS", 10)
    for step in range(100):
        shard_progress.copy_committed(ShardKey("j", step, 0, 2))
    assert len(shard_progress._committed_ranks) == 10
    assert ("j", 99, 2) in shard_progress._committed_ranks
