"""The save path is the one writer of a tier's catalog: a removal, an adoption of a missed commit and a replica
sender's record each wait for the catalog write under way (the seal lock), never overlap it."""

from __future__ import annotations

import asyncio
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from ckpt_core.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta

from ckptd.save.flush import Flusher
from ckptd.save.progress import ShardProgress
from ckptd.save.save_path import SavePath
from ckptd.save.staging import SlotPool
from ckptd.tiers.base import Listed
from ckptd.tiers.nvme import LocalDirTier

HELD_S = 1.5  # how long the first catalog write waits for a second one to overlap it (none may)


class WatchedTier(LocalDirTier):
    """A replica store that records each catalog write as it begins and ends; the first waits for a second to begin.

    A slow disk under the first write: where a second write did not wait for it, the second begins
    before the first ends, and the record shows it.
    """

    def __init__(self, root: object) -> None:
        super().__init__(root, "peer")
        self.writes: list[str] = []
        self.first_began = threading.Event()
        self._second_began = threading.Event()

    def _write(self, what: str, write):  # type: ignore[no-untyped-def]
        first = not self.writes
        self.writes.append(f"{what} begins")
        if first:
            self.first_began.set()
            self._second_began.wait(HELD_S)
        else:
            self._second_began.set()
        try:
            return write()
        finally:
            self.writes.append(f"{what} ends")

    def adopt_commit(self, record: CommitRecord) -> bool:
        return self._write(f"adopt {record.step}", lambda: super(WatchedTier, self).adopt_commit(record))

    def remove_step(self, job: str, step: int, listed: Listed | None = None) -> None:
        self._write(f"remove {step}", lambda: super(WatchedTier, self).remove_step(job, step, listed))


def shard(step: int) -> tuple[ShardMeta, memoryview]:
    return ShardMeta("j", step, 0, 1, 4096, CHUNK_SIZE_BYTES, (), "{}"), memoryview(mmap.mmap(-1, 4096))


@pytest.fixture
def roles(tmp_path):
    """Yield (save path, the watched replica store, step 2's commit record): step 1 complete there, step 2 not yet."""
    before = LocalDirTier(tmp_path / "replicas", "peer")  # what the store holds when the test begins
    before.write_shard(*shard(1))
    assert before.try_commit("j", 1, 1) is not None
    before.write_shard(*shard(2))  # its shard is here, its commit notice was missed
    elsewhere = LocalDirTier(tmp_path / "elsewhere")  # the peer that sealed step 2
    elsewhere.write_shard(*shard(2))
    record = elsewhere.try_commit("j", 2, 1)
    assert record is not None
    store = WatchedTier(tmp_path / "replicas")
    view = SimpleNamespace(commit_record=lambda job, step: record if step == 2 else None)

    async def nothing_to_seal(job: str, step: int, run: str | None) -> tuple[None, bool]:
        return None, False

    peering = SimpleNamespace(record_to_seal=nothing_to_seal)
    with ThreadPoolExecutor(2) as threads, ThreadPoolExecutor(1) as removal_thread:
        pool = SlotPool(tmp_path / "staging", 0, "block", memory_threads=threads)
        nvme = LocalDirTier(tmp_path / "nvme")
        saves = SavePath(
            pool, Flusher(pool, nvme, threads), nvme, store, [store], peering, None,
            ShardProgress(pool, nvme, None, None, "n", threads), None, view, threads, threads, removal_thread,
            threads, None, None,
        )  # type: ignore[arg-type]  # fmt: skip
        yield saves, store, record


FIRST = {
    "removal": lambda saves, store, record: saves.release(store, "j", 1, None),
    "missed commit": lambda saves, store, record: saves.adopt_missed_commits(store, "j"),
}
SECOND = {
    "removal": lambda saves, store, record: saves.release(store, "j", 1, None),
    "missed commit": lambda saves, store, record: saves.adopt_missed_commits(store, "j"),
    "sender's record": lambda saves, store, record: saves.replica_arrived(shard(2)[0], record),
}


@pytest.mark.parametrize(
    ("first", "second"),
    [("missed commit", "removal"), ("removal", "missed commit"), ("removal", "sender's record")],
)
def test_a_catalog_write_waits_for_the_one_under_way(roles, first, second):
    saves, store, record = roles

    async def body() -> None:
        under_way = asyncio.ensure_future(FIRST[first](saves, store, record))
        await asyncio.get_running_loop().run_in_executor(None, store.first_began.wait, 10)
        await asyncio.gather(under_way, SECOND[second](saves, store, record))

    asyncio.run(body())
    begun = [w.removesuffix(" begins") for w in store.writes if w.endswith("begins")]
    assert store.writes == [f"{begun[0]} begins", f"{begun[0]} ends", f"{begun[1]} begins", f"{begun[1]} ends"]
    assert 1 not in store.all_steps("j") and store.complete_steps("j") == [2]
