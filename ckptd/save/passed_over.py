"""Remember the snapshots a newer save replaced before the disk was free for them, and say so.

At a high save rate the flusher writes the newest snapshot of a job whenever the disk is
free and passes over the ones in between (see rounds): those shards never reach NVMe, nor
the peer and object tiers that follow the flush. Who calls what, all on the event loop:
the Flusher calls passed_over() when a round passes a snapshot over or a save claims its
slot; ShardProgress calls why() for WaitShard and forget() when the shard is saved again;
StatusReport reads by_job() for `ckptd status` and /metrics.

Counted once per (job, step) on this node; logged at INFO at most once per LOG_EVERY_S per
job (with the count since the last line), so that 10 saves a second do not make 10 lines.
Every table is bounded (the oldest entries go first), by the limits ShardProgress hands it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ckpt_core.shard_key import ShardKey

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0


@dataclass
class JobPassedOver:
    """One job's passed-over steps on this node: how many, and the newest one with the step that replaced it."""

    steps: int = 0
    last_step: int = -1
    replaced_by: int = -1
    logged_at: float = float("-inf")  # time.monotonic() of the last log line
    since_logged: int = 0  # steps passed over since that line


class PassedOver:
    """Keep which shards were passed over on NVMe and why; count the steps per job."""

    def __init__(self, remembered_shards: int, max_jobs: int) -> None:
        self.remembered_shards = remembered_shards
        self.max_jobs = max_jobs
        self._shards: OrderedDict[ShardKey, str] = OrderedDict()  # shard -> the error WaitShard answers
        self._steps: OrderedDict[tuple[str, int], None] = OrderedDict()  # (job, step) counted already
        self._jobs: OrderedDict[str, JobPassedOver] = OrderedDict()

    def passed_over(self, key: ShardKey, newer_step: int) -> None:
        """Record that a newer snapshot (of newer_step) replaced the shard's before its flush started."""
        self._shards[key] = (
            f"{key.job} step {key.step} rank {key.rank} was passed over on NVMe: a newer snapshot (step "
            f"{newer_step}) replaced it before the disk was free for it (saves outran the flush; "
            "[nvme] flush_every keeps chosen steps)"
        )
        self._shards.move_to_end(key)
        _bound(self._shards, self.remembered_shards)
        if (key.job, key.step) in self._steps:
            return
        self._steps[(key.job, key.step)] = None
        _bound(self._steps, self.remembered_shards)
        job = self._jobs.pop(key.job, None) or JobPassedOver()
        self._jobs[key.job] = job  # the job passed over most recently goes last, the one longest ago first out
        _bound(self._jobs, self.max_jobs)
        job.steps += 1
        job.since_logged += 1
        job.last_step, job.replaced_by = key.step, newer_step
        now = time.monotonic()
        if now - job.logged_at >= LOG_EVERY_S:
            log.info(
                "%s: %d step(s) passed over on NVMe since the last report (newest: step %d, replaced by step %d); "
                "saves come faster than this node's disk takes them",
                key.job, job.since_logged, key.step, newer_step,
            )  # fmt: skip
            job.logged_at, job.since_logged = now, 0

    def why(self, key: ShardKey) -> str | None:
        """Return the error for a passed-over shard on NVMe, peer or object, or None."""
        return self._shards.get(key)

    def forget(self, key: ShardKey) -> None:
        """Forget a shard saved again: its new copy is flushed as any other."""
        self._shards.pop(key, None)

    def by_job(self) -> dict[str, dict[str, int]]:
        """Return job -> {steps, last_step, replaced_by} (a copy, for status and /metrics)."""
        return {
            job: {"steps": p.steps, "last_step": p.last_step, "replaced_by": p.replaced_by}
            for job, p in sorted(self._jobs.items())
        }


def _bound(table: OrderedDict[Any, Any], limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)
