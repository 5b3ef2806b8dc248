"""The status document of `ckptd status --json` and the /metrics page built from it.

Called on the event loop (Status RPC, /metrics scrapes): what it reads from the disk
(the jobs on each tier) is listed on a worker thread first; the rest is in memory.
Ages of the newest complete steps are learnt once at start (seed()) and kept up to
date by ShardProgress, so scrapes touch no disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ckptd import __version__, metrics
from ckptd.config import Config
from ckptd.datapath.flush import Flusher
from ckptd.datapath.peering import Peering
from ckptd.datapath.progress import ShardProgress
from ckptd.datapath.retention import RetentionRunner
from ckptd.datapath.staging import SlotPool
from ckptd.datapath.uploading import Uploader
from ckptd.tiers.base import DurableTier
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier

LOOP_PROBE_S = 0.1  # how often the event loop's responsiveness is sampled


class StatusReport:
    """Gather what every role counts into one document."""

    def __init__(
        self,
        config: Config,
        pool: SlotPool,
        memory: MemoryTier,
        nvme: LocalDirTier,
        durable_tiers: list[DurableTier],
        flusher: Flusher,
        progress: ShardProgress,
        peering: Peering,
        uploader: Uploader | None,
        retention: RetentionRunner,
    ) -> None:
        self.config = config
        self.pool = pool
        self.memory = memory
        self.nvme = nvme
        self.durable_tiers = durable_tiers
        self.flusher = flusher
        self.progress = progress
        self.peering = peering
        self.uploader = uploader
        self.retention = retention
        self.started_unix_s = time.time()
        self.verification_failures: Counter[str] = Counter()  # by tier: a bad byte caught on its way
        self.replica_bytes_received = 0
        self.loop_max_stall_s = 0.0  # the longest the event loop was late, since start
        self.rpc_counters: Callable[[], dict[str, int]] = dict  # the RPC layer's own (set by the daemon)

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way (a chunk that did not match its checksum)."""
        self.verification_failures[tier] += 1

    def seed(self) -> None:
        """Learn when the newest complete step of each durable tier was committed (a worker thread, at start)."""
        for tier in self.durable_tiers:
            for job in tier.jobs():
                steps = tier.complete_steps(job)
                if steps:
                    with contextlib.suppress(OSError):
                        t = tier.committed_unix_s(job, steps[-1])
                        completed = self.progress.completed_unix_s
                        completed[tier.name] = max(completed.get(tier.name, 0.0), t)

    async def probe_loop(self) -> None:
        """Sample how late the event loop runs a timer: the longest stall clients and peers felt (runs forever)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_PROBE_S
            await asyncio.sleep(LOOP_PROBE_S)  # a period, not a wait for anything
            self.loop_max_stall_s = max(self.loop_max_stall_s, loop.time() - due)

    async def document(self) -> dict[str, Any]:
        """Return the status document (the job listings are read on a worker thread)."""
        jobs = await asyncio.to_thread(lambda: (self.memory.jobs(), self.nvme.jobs()))
        return self._document(*jobs)

    async def metrics_page(self) -> str:
        """Return the /metrics page: what `status` says, and the durations observed."""
        histograms = [self.flusher.save_seconds, self.flusher.flush_seconds]
        if self.uploader is not None:
            histograms.append(self.uploader.upload_seconds)
        return metrics.page(await self.document(), histograms)

    def _newest_step_ages(self) -> dict[str, float]:
        now = time.time()
        ages = {tier: max(0.0, now - t) for tier, t in self.progress.completed_unix_s.items()}
        if self.uploader is not None and self.uploader.last_commit_unix_s:
            ages["object"] = max(0.0, now - self.uploader.last_commit_unix_s)
        return ages

    def _document(self, memory_jobs: list[str], nvme_jobs: list[str]) -> dict[str, Any]:
        slots = self.pool.slots()
        failures = self.verification_failures
        return {
            "version": __version__,
            "node": self.config.node.name,
            "cpus": sorted(os.sched_getaffinity(0)),  # where it runs: [node] cpus, else what it was given
            "uptime_s": round(time.time() - self.started_unix_s, 3),
            "socket": str(self.config.socket_path),
            "tiers": {
                "memory": {"dir": str(self.config.staging_dir), "jobs": memory_jobs},
                "nvme": {"root": str(self.config.root), "jobs": nvme_jobs},
                "peer": {"replica_root": str(self.config.replica_root), **self.peering.status()},
                "object": self.uploader.status() if self.uploader is not None else {"enabled": False},
            },
            "staging": {
                "policy": self.config.staging.policy,
                "budget_bytes": self.config.staging.budget_bytes,
                "in_use_bytes": self.pool.in_use_bytes(),
                "bytes_by_job": _bytes_by_job(slots),
                "slots": len(slots),
                "pending_flushes": sum(1 for s in slots if s.state == "pending"),
            },
            "counters": {
                **self.flusher.counters,
                "replica_bytes_received": self.replica_bytes_received,
                "removal_failures": self.retention.removal_failures(),
                **self.rpc_counters(),
                "verification_failures": {
                    **dict.fromkeys(("memory", "nvme", "peer", "object"), 0),
                    **failures,
                    "nvme": failures["nvme"] + (self.uploader.verification_failures if self.uploader else 0),
                },
            },
            "event_loop": {"max_stall_s": round(self.loop_max_stall_s, 4)},
            "newest_complete_age_s": {tier: round(age, 3) for tier, age in self._newest_step_ages().items()},
            "recent_errors": list(self.progress.errors),
        }


def _bytes_by_job(slots: list[Any]) -> dict[str, int]:
    held: dict[str, int] = {}
    for s in slots:
        held[s.job] = held.get(s.job, 0) + max(s.size_bytes, s.allocating_bytes)
    return held
