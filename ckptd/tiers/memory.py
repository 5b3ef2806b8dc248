"""Serve the newest snapshot of each rank from the shared-memory staging slots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckpt_core.errors import NotFound
from ckpt_core.format import CommitRecord, digest
from ckpt_core.shard_io import ShardSource

from ckptd.tiers.base import Tier
from ckptd.tiers.slot_files import Slot, scan_slots


class MemoryTier(Tier):
    """List a step as complete in memory when every rank's checksummed snapshot of it is in a slot."""

    name = "memory"

    def __init__(self, slots: Callable[[], list[Slot]]) -> None:
        self._slots = slots

    @classmethod
    def from_directory(cls, directory: Path) -> MemoryTier:
        """Read a staging directory directly, with no daemon (for restore and verify)."""
        return cls(lambda: scan_slots(directory))

    def _held(self, job: str, step: int) -> dict[int, Slot]:
        """Return, by rank, the checksummed slots holding the job's step, of the newest run that saved it.

        Of two copies of one rank's shard (the step was saved again), the later commit wins.
        """
        slots = [s for s in self._slots() if s.job == job and s.state != "writing" and s.shard and s.shard.step == step]
        if not slots:
            return {}
        newest = max(slots, key=lambda s: s.committed_seq)
        world_size = newest.shard.world_size if newest.shard else 0
        latest: dict[int, Slot] = {}
        for s in sorted(slots, key=lambda s: s.committed_seq):
            # Copies of one run only (as on disk), and of the world size it saved with.
            if s.shard and s.shard.world_size == world_size and s.run_id == newest.run_id:
                latest[s.rank] = s
        # A rank whose latest copy is not checksummed yet is not served: never an older copy instead.
        return {rank: s for rank, s in latest.items() if s.meta is not None}

    def jobs(self) -> list[str]:
        return sorted({s.job for s in self._slots() if s.meta is not None})

    def complete_steps(self, job: str) -> list[int]:
        steps = {s.shard.step for s in self._slots() if s.job == job and s.meta and s.shard}
        return sorted(step for step in steps if self._is_complete(self._held(job, step)))

    @staticmethod
    def _is_complete(held: dict[int, Slot]) -> bool:
        """Say whether every rank is held, all on one line of the job's history (never complete otherwise)."""
        world_size = next(iter(held.values())).shard.world_size if held else 0  # type: ignore[union-attr]
        one_line = len({s.meta.line for s in held.values() if s.meta is not None}) == 1
        return bool(held) and sorted(held) == list(range(world_size)) and one_line

    def commit_record(self, job: str, step: int) -> CommitRecord:
        held = self._held(job, step)
        if not self._is_complete(held):
            raise NotFound(f"{job} step {step} is not complete in memory")
        world_size = len(held)
        metas = [held[r].meta for r in range(world_size)]
        return CommitRecord(
            job,
            step,
            world_size,
            tuple(digest(m.to_bytes()) for m in metas if m),
            sum(m.data_size_bytes for m in metas if m),
            metas[0].line if metas[0] else (),
            max((m.saved_at for m in metas if m), default=""),
        )

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        return rank in self._held(job, step)

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        slot = self._held(job, step).get(rank)
        if slot is None:
            raise NotFound(f"rank {rank} shard of {job} step {step} is not in memory")
        return ShardSource(self.name, "slot", str(slot.path), job, step)
