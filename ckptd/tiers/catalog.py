"""List the complete steps a set of tiers holds, as `ckptd ls` shows them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckpt.errors import NotFound

from ckptd.tiers.base import Tier


@dataclass(frozen=True)
class StepInfo:
    """One complete step and the tiers holding a complete copy of it."""

    job: str
    step: int
    world_size: int
    size_bytes: int
    tiers: tuple[str, ...]


def merge_steps(steps: list[StepInfo], more: list[StepInfo]) -> list[StepInfo]:
    """Return steps with more folded in: a step in both lists holds the tiers of both."""
    found = {(i.job, i.step): i for i in steps}
    for i in more:
        prev = found.get((i.job, i.step))
        found[(i.job, i.step)] = i if prev is None else dataclasses.replace(prev, tiers=(*prev.tiers, *i.tiers))
    return [found[k] for k in sorted(found)]


def list_steps(tiers: list[Tier], job: str = "") -> list[StepInfo]:
    """Return every step complete on any of the tiers (of one job, or all), by job and step."""
    found: dict[tuple[str, int], StepInfo] = {}
    for tier in tiers:
        for j in [job] if job else tier.jobs():
            for step in tier.complete_steps(j):
                try:
                    record = tier.commit_record(j, step)
                except NotFound:
                    continue  # removed since it was listed
                prev = found.get((j, step))
                tiers_holding = (*prev.tiers, tier.name) if prev else (tier.name,)
                found[(j, step)] = StepInfo(j, step, record.world_size, record.size_bytes, tiers_holding)
    return [found[k] for k in sorted(found)]
