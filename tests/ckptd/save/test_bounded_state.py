"""Every table the daemon keeps per shard or per step is bounded: the oldest entries go first."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.shard_key import ShardKey

from ckptd.keyed import KeyCounts, KeyedLocks, ThreadKeyedLocks
from ckptd.save import progress, save_path
from ckptd.save.flush import Flusher
from ckptd.save.progress import ShardProgress
from ckptd.save.save_path import SavePath
from ckptd.save.staging import SlotPool
from ckptd.tiers.nvme import LocalDirTier

BOUND = 10


@pytest.fixture
def roles(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "REMEMBERED_SHARDS", BOUND)
    monkeypatch.setattr(save_path, "REMEMBERED_SHARDS", BOUND)
    nvme = LocalDirTier(tmp_path / "nvme")
    with ThreadPoolExecutor(1) as threads:
        pool = SlotPool(tmp_path / "staging", 0, "block", memory_threads=threads)
        shard_progress = ShardProgress(
            pool, nvme, replication=None, uploader=None, node="n", threads=threads
        )  # peers and store play no part here
        flusher = Flusher(pool, nvme, threads)
        saves = SavePath(
            pool, flusher, nvme, nvme, [nvme], peering=None, uploader=None, progress=shard_progress, retention=None,
            view=None, save_threads=threads, peer_threads=threads, removal_threads=threads, object_threads=threads,
            client_retention=None, object_step=None,
        )  # fmt: skip
        yield shard_progress, saves


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
    _, saves = roles
    for step in range(100):
        saves._note_run(ShardKey("j", step, 0, 1), f"run-{step}")
    assert len(saves._latest_run) == BOUND
    assert saves._latest_run[("j", 99)] == "run-99"


def test_keyed_locks_serialise_in_order_and_keep_nothing_once_unused():
    locks: KeyedLocks[str] = KeyedLocks()
    events: list[str] = []
    inside = 0

    async def flush(name: str, release: asyncio.Event) -> None:
        nonlocal inside
        async with locks.hold("rank-0"):
            inside += 1
            assert inside == 1, "two holders of one key at once"
            events.append(f"{name} in")
            await release.wait()
            events.append(f"{name} out")
            inside -= 1

    async def body() -> None:
        releases = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.ensure_future(flush(n, r)) for n, r in zip("abc", releases, strict=True)]
        for release in releases:
            while len(events) % 2 == 0:  # wait until the next holder is in (the loop runs the others)
                await asyncio.sleep(0)
            assert len(locks) == 1
            release.set()
            while len(events) % 2 == 1:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    asyncio.run(body())
    assert events == ["a in", "a out", "b in", "b out", "c in", "c out"]
    assert len(locks) == 0


def test_key_counts_forget_a_key_once_its_last_user_is_done():
    counts: KeyCounts[tuple[str, int]] = KeyCounts()
    with counts.counting(("j", 1)):
        with counts.counting(("j", 1)):
            assert counts.keys() == {("j", 1)}
        assert counts.keys() == {("j", 1)}  # the other fetch of the step is still under way
    assert counts.keys() == set()


def test_thread_keyed_locks_hold_one_thread_per_key_and_keep_nothing_once_unused():
    locks: ThreadKeyedLocks[str] = ThreadKeyedLocks()
    first_in, release = threading.Event(), threading.Event()
    order: list[str] = []

    def listing(name: str, key: str) -> None:
        with locks.hold(key):
            order.append(f"{name} in")
            if name == "a":
                first_in.set()
                release.wait()
            order.append(f"{name} out")

    a = threading.Thread(target=listing, args=("a", "job"))
    a.start()
    first_in.wait()
    b = threading.Thread(target=listing, args=("b", "job"))  # waits for a
    b.start()
    listing("c", "other job")  # another key: not held up by a
    assert order == ["a in", "c in", "c out"]
    release.set()
    a.join()
    b.join()
    assert order[3:] == ["a out", "b in", "b out"]
    assert len(locks) == 0
