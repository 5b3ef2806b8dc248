"""Check every byte of a step on each tier, with no daemon: `ckptd verify`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ckpt_core.errors import CheckpointError, NotFound

from ckptd.load.fetch import aligned_buffer
from ckptd.tiers.base import Tier


@dataclass(frozen=True)
class ShardCheck:
    """The outcome of checking one shard on one tier."""

    tier: str
    job: str
    step: int
    rank: int
    error: str  # "" when every byte checks

    @property
    def ok(self) -> bool:
        return not self.error


def verify(tiers: list[Tier], job: str, step: int | None, spread: bool = False) -> Iterator[ShardCheck]:
    """Check every shard of step (or of every complete step) of job on each tier.

    With spread (the node has peers), a rank a tier does not hold is not an error:
    a step spread over nodes keeps the other ranks' shards on other nodes.
    """
    for tier in tiers:
        steps = tier.complete_steps(job) if step is None else [step]
        if step is not None and len(tiers) > 1 and step not in tier.complete_steps(job):
            continue  # checking every tier that holds the step; this one does not
        for s in steps:
            try:
                world_size = tier.commit_record(job, s).world_size
            except CheckpointError as e:
                yield ShardCheck(tier.name, job, s, -1, str(e))
                continue
            for rank in range(world_size):
                if spread and tier.name in ("nvme", "peer") and not tier.has_shard(job, s, rank):
                    continue
                try:
                    meta = tier.read_meta(job, s, rank)
                    with aligned_buffer(meta.data_size_bytes) as buf:
                        tier.read_into(meta, buf)
                    yield ShardCheck(tier.name, job, s, rank, "")
                except CheckpointError as e:
                    if isinstance(e, NotFound) and tier.name == "memory":
                        continue  # a running daemon reused the slot for a newer snapshot: nothing is wrong
                    yield ShardCheck(tier.name, job, s, rank, str(e))
