"""Name one rank's shard of one step: the key the save path, replication and the RPC edge share.

A frozen value with no behaviour beyond its text, so it sits below every package that
uses it (staging and its slot files, flush, progress, upload, replication, the servicer).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardKey:
    """Name one rank's shard of one step of a job."""

    job: str
    step: int
    rank: int
    world_size: int

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world_size} shard of {self.job} step {self.step}"
