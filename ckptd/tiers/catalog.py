"""List the complete steps a set of tiers holds, as `ckptd ls` shows them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckpt_core.errors import NotFound
from ckpt_core.format import CommitRecord
from ckpt_core.history import History, Line

from ckptd.tiers.base import Tier


@dataclass(frozen=True)
class StepInfo:
    """One complete step and the tiers holding a complete copy of it."""

    job: str
    step: int
    world_size: int
    size_bytes: int
    tiers: tuple[str, ...]
    committed_at: str = ""  # its commit record's (UTC, ISO 8601); "" for steps saved before records had it
    line: Line = ()  # its line of the job's history (ckpt_core.history)
    superseded: bool = False  # off the job's line: set by whoever lists the job's steps together
    pinned: bool = False  # kept by `ckptd pin` on this node (Locator.list_steps marks it)

    @classmethod
    def of(cls, record: CommitRecord, tiers: tuple[str, ...]) -> StepInfo:
        """Describe a complete step by its commit record."""
        return cls(
            record.job, record.step, record.world_size, record.size_bytes, tiers, record.committed_at, record.line
        )


def merge_steps(steps: list[StepInfo], more: list[StepInfo]) -> list[StepInfo]:
    """Return steps with more folded in: a step in both lists holds the tiers of both."""
    found = {(i.job, i.step): i for i in steps}
    for i in more:
        prev = found.get((i.job, i.step))
        found[(i.job, i.step)] = i if prev is None else dataclasses.replace(prev, tiers=(*prev.tiers, *i.tiers))
    return [found[k] for k in sorted(found)]


def with_superseded(steps: list[StepInfo]) -> list[StepInfo]:
    """Return steps (of any jobs, all of each job's complete steps known) with each one off its job's line marked."""
    by_job: dict[str, History] = {}
    for job in {i.job for i in steps}:
        by_job[job] = History.of({i.step: i.line for i in steps if i.job == job})
    return [dataclasses.replace(i, superseded=by_job[i.job].is_superseded(i.step)) for i in steps]


def head_of(steps: list[StepInfo]) -> StepInfo | None:
    """Return the head among one job's complete steps: the newest step of the newest line."""
    head = History.of({i.step: i.line for i in steps}).head
    return next((i for i in steps if i.step == head), None)


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
                found[(j, step)] = StepInfo.of(record, tiers_holding)
    return with_superseded([found[k] for k in sorted(found)])
