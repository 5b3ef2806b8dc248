"""Locating a shard that a tier drops on another thread between two looks (memory's retention, mid-Locate)."""

from __future__ import annotations

from types import SimpleNamespace

from ckpt_core.errors import NotFound
from ckpt_core.format import CommitRecord
from ckpt_core.shard_io import ShardSource

from ckptd.load.locate import Locator


class DroppedMidway:
    """A tier that says it holds step 1 and, asked for it next, no longer does."""

    name = "memory"

    def complete_steps(self, job: str) -> set[int]:
        return {1}

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        return True

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        raise NotFound(f"rank {rank} shard of {job} step {step} is not in memory")

    def commit_record(self, job: str, step: int) -> CommitRecord:
        raise NotFound(f"{job} step {step} is not complete in memory")


class Holds:
    """A tier that holds step 1 for good."""

    name = "nvme"
    record = CommitRecord("j", 1, 1, ("00" * 16,), 8)

    def complete_steps(self, job: str) -> set[int]:
        return {1}

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        return True

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        return ShardSource(self.name, "dir", "/nvme/j/1", job, step)

    def commit_record(self, job: str, step: int) -> CommitRecord:
        return self.record


def test_a_copy_dropped_between_looks_is_no_source_and_the_next_tier_answers() -> None:
    tiers = [DroppedMidway(), Holds()]
    sources = Locator.local_sources(tiers, "j", 1, 0, Holds.record)  # type: ignore[arg-type]
    assert [s.tier for s in sources] == ["nvme"]
    locator = SimpleNamespace(tiers=tiers)
    assert Locator.commit_record_here(locator, "j", 1) is Holds.record  # type: ignore[arg-type]
