"""Decide which steps a tier drops: past the newest N complete ones, and abandoned partial ones."""

from __future__ import annotations


def plan_removals(all_steps: list[int], complete_steps: list[int], keep: int, busy: set[int]) -> list[tuple[int, str]]:
    """Return (step, reason) for each step to remove from a tier, oldest first.

    keep is the number of newest complete steps to keep (0 keeps all). An
    incomplete step older than the newest complete one can no longer complete
    unless a shard of it is still being written. A busy step is never removed
    (being written, read by a load, or not yet on a slower tier), nor is the
    newest complete step.
    """
    complete = sorted(complete_steps)
    removals: dict[int, str] = {}
    if keep > 0:
        for step in complete[:-keep]:
            if step not in busy:
                removals[step] = f"older than the newest {keep} complete steps"
    if complete:
        newest = complete[-1]
        for step in all_steps:
            if step < newest and step not in complete and step not in busy:
                removals[step] = "incomplete, and older than the newest complete step"
        removals.pop(newest, None)
    return sorted(removals.items())
