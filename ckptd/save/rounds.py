"""Pick the step each flush round of a job writes to NVMe, and the snapshots it passes over.

Saves may come faster than a disk takes them. The memory tier takes every save; the
disk takes one step of a job at a time, in rounds: a round picks one step and flushes
every local rank's shard of it, so that the ranks of a job on a node flush the same
steps (with 8 ranks and 2 flush threads, ranks that each flushed their own newest
snapshot would never complete a step). Which step, with `[nvme] flush_every`:

- 0 (newest wins): the newest step that every rank holding an unflushed snapshot, or copying
  a save, holds (the ranks agree). Where none is held by all (a rank replaced a step the others still
  hold, or lags behind), the round waits a little for the ranks' next commits; if they
  still disagree, it takes the newest step any rank holds. Unflushed snapshots of older
  steps are passed over, every rank's at once.
- N >= 1: the oldest unflushed step that is a multiple of N (kept: never passed over,
  its slot never claimed by a newer save; no agreement needed, every rank flushes it);
  with none, as for 0, passing over no kept step.

Flusher calls plan_round() on the event loop while a job's round waits to start; the
slot states it reads change on the event loop only, so a plan holds until it awaits.
SlotPool calls kept() when a rank's save looks for a slot to claim.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.tiers.slot_files import Slot


def kept(step: int, flush_every: int) -> bool:
    """Say whether [nvme] flush_every keeps a step: always flushed, never passed over."""
    return flush_every > 0 and step % flush_every == 0


@dataclass(frozen=True)
class Round:
    """One round of a job: the step, one slot per rank holding it, and the older snapshots it passes over."""

    step: int
    agreed: bool  # every rank with an unflushed snapshot or a copy under way holds the step (or flush_every keeps it)
    flushed: tuple[Slot, ...]
    passed_over: tuple[Slot, ...]  # older steps, never to be flushed
    superseded: tuple[Slot, ...]  # earlier copies of the flushed shards (a step saved again): dropped silently


def plan_round(slots: list[Slot], flush_every: int) -> Round | None:
    """Return the next round for a job's slots (every rank's), or None when no snapshot waits for its flush."""
    pending = [s for s in slots if s.state == "pending" and s.shard is not None]
    holders: dict[int, set[int]] = {}  # step -> the ranks holding it unflushed
    for s in pending:
        assert s.shard is not None
        holders.setdefault(s.shard.step, set()).add(s.rank)
    if not holders:
        return None
    kept_steps = [step for step in holders if kept(step, flush_every)]
    # A rank copying a save counts too: the pending snapshot it had may be the slot it is copying into
    # (claimed), and a round without it would flush a step it no longer holds.
    ranks = set().union(*holders.values()) | {s.rank for s in slots if s.state == "writing"}
    common = [step for step, held in holders.items() if held == ranks]
    step = min(kept_steps) if kept_steps else max(common or holders)
    agreed = bool(kept_steps or common)
    newest_copy: dict[int, Slot] = {}  # rank -> its latest copy of the step
    for s in sorted((s for s in pending if s.shard and s.shard.step == step), key=lambda s: s.committed_seq):
        newest_copy[s.rank] = s
    flushed = tuple(newest_copy.values())
    superseded = tuple(s for s in pending if s.shard and s.shard.step == step and all(s is not f for f in flushed))
    passed_over = tuple(s for s in pending if s.shard and s.shard.step < step and not kept(s.shard.step, flush_every))
    return Round(step, agreed, flushed, passed_over, superseded)
