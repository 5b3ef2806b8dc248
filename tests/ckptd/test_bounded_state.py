"""Every table the daemon keeps per shard or per step is bounded: the oldest entries go first."""

from __future__ import annotations

import pytest

from ckptd.datapath import flush, progress
from ckptd.datapath.flush import Flusher
from ckptd.datapath.progress import ShardProgress
from ckptd.datapath.staging import ShardKey, SlotPool
from ckptd.tiers.nvme import LocalDirTier

BOUND = 10


@pytest.fixture
def roles(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "REMEMBERED_SHARDS", BOUND)
    monkeypatch.setattr(flush, "REMEMBERED_SHARDS", BOUND)
    pool = SlotPool(tmp_path / "staging", 0, "block")
    nvme = LocalDirTier(tmp_path / "nvme")
    shard_progress = ShardProgress(pool, nvme, peering=None, uploader=None)  # peers and store play no part here
    flusher = Flusher(pool, nvme, [nvme], peering=None, uploader=None, progress=shard_progress)
    yield shard_progress, flusher
    flusher.threads.shutdown()
    flusher.save_threads.shutdown()
    nvme.close()


def test_what_shards_reached_and_why_they_failed_is_bounded(roles):
    shard_progress, _ = roles
    keys = [ShardKey("j", step, 0, 1) for step in range(100)]
    for key in keys:
        shard_progress.copy_committed(key)
        shard_progress.reached(key, "nvme")
        shard_progress.failed(key, "peer", "the peer refused")
    assert len(shard_progress._reached) == BOUND
    assert len(shard_progress._failures) == BOUND
    assert (keys[-1], "nvme") in shard_progress._reached and keys[-1] in shard_progress._failures  # newest kept
    assert len(shard_progress.errors) <= progress.RECENT_ERRORS


def test_the_run_that_committed_each_step_is_remembered_for_the_newest_steps_only(roles):
    _, flusher = roles
    for step in range(100):
        flusher.note_run(ShardKey("j", step, 0, 1), f"run-{step}")
    assert len(flusher._latest_run) == BOUND
    assert flusher._latest_run[("j", 99)] == "run-99"
