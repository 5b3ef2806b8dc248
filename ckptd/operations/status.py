"""The status document of `ckptd status --json` and the /metrics page built from it.

Called on the event loop: the Status RPC awaits document(), which lists the jobs on
each tier on a status thread (Executors.status), then adds what snapshot() reads from memory and
each job's retention (JobRetention.describe, from memory); a /metrics
scrape awaits metrics_page(), which takes snapshot() alone and renders it on a status
thread, so a scrape touches no disk and keeps the event loop for a moment only. The
newest complete step of each job on NVMe is learnt once at start (seed(), on a worker
thread, before any RPC) and kept up to date by ShardProgress.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from concurrent.futures import Executor
from typing import Any

from ckpt_core.history import History, generation

from ckptd import __version__, metrics
from ckptd.cluster.view import ClusterView
from ckptd.config import Config
from ckptd.operations.job_retention import JobRetention
from ckptd.operations.retention import RetentionRunner
from ckptd.replication.peering import Peering
from ckptd.save.flush import Flusher
from ckptd.save.progress import Completion, ShardProgress
from ckptd.save.save_path import SavePath
from ckptd.save.staging import SlotPool
from ckptd.save.uploading import Uploader
from ckptd.tiers.base import DurableTier, Tier
from ckptd.tiers.slot_files import UNFLUSHED

LOOP_PROBE_S = 0.1  # how often the event loop's responsiveness is sampled


class StatusReport:
    """Gather what every role counts into one document."""

    def __init__(
        self,
        config: Config,
        pool: SlotPool,
        memory: Tier,
        nvme: DurableTier,
        flusher: Flusher,
        save_path: SavePath,
        progress: ShardProgress,
        peering: Peering,
        view: ClusterView | None,
        uploader: Uploader | None,
        retention: RetentionRunner,
        job_retention: JobRetention,
        threads: Executor,
    ) -> None:
        """threads: where the jobs are listed and the /metrics page rendered (Executors.status)."""
        self.config = config
        self._threads = threads
        self.pool = pool
        self.memory = memory
        self.nvme = nvme
        self.flusher = flusher
        self.save_path = save_path
        self.progress = progress
        self.peering = peering
        self.view = view
        self.uploader = uploader
        self.retention = retention
        self.job_retention = job_retention
        self.started_unix_s = time.time()
        self.verification_failures: Counter[str] = Counter()  # by tier: a bad byte caught on its way
        self.data_port = 0  # where this node takes replicas' bytes beside gRPC; 0 = by gRPC only
        self.loop_max_stall_s = 0.0  # the longest the event loop was late, since start
        self._rpc_counters: dict[str, int] = {}  # the RPC layer's own, read at each report (Node.serving)
        self.histograms = [save_path.save_seconds, flusher.flush_seconds]
        if uploader is not None:
            self.histograms.append(uploader.upload_seconds)

    def serving(self, data_port: int, rpc_counters: dict[str, int]) -> None:
        """Learn what the RPC edges serve: the peer data port (0: none) and their counters, a live dict (at start)."""
        self.data_port = data_port
        self._rpc_counters = rpc_counters

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way (a chunk that did not match its checksum)."""
        self.verification_failures[tier] += 1

    def seed(self) -> None:
        """Learn each job's head on NVMe (ckpt_core.history) and when it was sealed (a worker thread, at start)."""
        for job in self.nvme.jobs():
            records = self.nvme.complete_records(job)
            head = History.of({s: r.line for s, r in records.items()}).head
            if head is not None:
                with contextlib.suppress(OSError):  # removed since it was listed
                    when = self.nvme.committed_unix_s(job, head)
                    self.progress.step_completed("nvme", job, head, when, generation(records[head].line))

    async def probe_loop(self) -> None:
        """Sample how late the event loop runs a timer: the longest stall clients and peers felt (runs forever)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_PROBE_S
            await asyncio.sleep(LOOP_PROBE_S)  # a period, not a wait for anything
            self.loop_max_stall_s = max(self.loop_max_stall_s, loop.time() - due)

    async def document(self) -> dict[str, Any]:
        """Return the status document: snapshot() and the jobs on each tier (listed on a status thread)."""
        memory_jobs, nvme_jobs = await asyncio.get_running_loop().run_in_executor(
            self._threads, lambda: (self.memory.jobs(), self.nvme.jobs())
        )
        await self.peering.recheck_unreachable()
        found = self.snapshot()
        found["tiers"]["memory"]["jobs"] = memory_jobs
        found["tiers"]["nvme"]["jobs"] = nvme_jobs
        found["retention"] = self.job_retention.describe(nvme_jobs)  # job -> what retention keeps of it here
        return found

    async def metrics_page(self) -> str:
        """Return the /metrics page: what snapshot() says, and the durations observed (rendered on a status thread)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, metrics.page, self.snapshot(), self.histograms
        )

    def snapshot(self) -> dict[str, Any]:
        """Return the status document but the job listings: memory only, quick enough for the event loop."""
        slots = self.pool.slots()
        failures = self.verification_failures
        newest = _newest_complete(self.progress.newest_by_job(), {s.job for s in slots}, time.time())
        passed_over = self.progress.passed_over_by_job()
        peer = self.peering.status()
        return {
            "version": __version__,
            "node": self.config.node.name,
            "cpus": sorted(os.sched_getaffinity(0)),  # where it runs: [node] cpus, else what it was given
            "uptime_s": round(time.time() - self.started_unix_s, 3),
            "socket": str(self.config.socket_path),
            "tiers": {
                "memory": {"dir": str(self.config.staging_dir)},
                "nvme": {"root": str(self.config.root), "flush_every": self.config.nvme.flush_every},
                "peer": {
                    "replica_root": str(self.config.replica_root),
                    "data_port": self.data_port,
                    **peer,
                },
                "object": self.uploader.status() if self.uploader is not None else {"enabled": False},
            },
            "cluster": _cluster_status(self.view.status(), peer) if self.view is not None else {"backend": "none"},
            "staging": {
                "policy": self.config.staging.policy,
                "budget_bytes": self.pool.budget_bytes,
                "job_budget_bytes": self.pool.job_budget_bytes,
                "in_use_bytes": self.pool.in_use_bytes(),
                "bytes_by_job": _bytes_by_job(slots),
                "slots": len(slots),
                "pending_flushes": sum(1 for s in slots if s.state in UNFLUSHED),
            },
            "counters": {
                **self.save_path.counters,
                **self.flusher.counters,
                "passed_over": sum(p["steps"] for p in passed_over.values()),
                "removal_failures": self.retention.removal_failures(),
                **self._rpc_counters,
                "verification_failures": {
                    **dict.fromkeys(("memory", "nvme", "peer", "object"), 0),
                    **failures,
                    "nvme": failures["nvme"] + (self.uploader.verification_failures if self.uploader else 0),
                },
            },
            "event_loop": {"max_stall_s": round(self.loop_max_stall_s, 4)},
            "newest_complete": newest,
            "passed_over": passed_over,  # job -> steps passed over on NVMe here, the last one and what replaced it
            "newest_complete_age_s": _youngest_by_tier(newest),  # deprecated: the same, any job
            "recent_errors": list(self.progress.errors),
        }


def _newest_complete(
    by_job: dict[str, dict[str, Completion]], staged_jobs: set[str], now_unix_s: float
) -> dict[str, dict[str, dict[str, float]]]:
    """Return job -> tier -> {step, completed_unix_s, age_s}; memory only for jobs that still hold slots."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    for job, tiers in sorted(by_job.items()):
        held = {tier: c for tier, c in tiers.items() if tier != "memory" or job in staged_jobs}
        if held:
            found[job] = {
                tier: {"step": c.step, "completed_unix_s": round(c.unix_s, 3), "age_s": _age(c, now_unix_s)}
                for tier, c in sorted(held.items(), key=lambda item: metrics.TIERS.index(item[0]))
            }
    return found


def _age(completion: Completion, now_unix_s: float) -> float:
    return round(max(0.0, now_unix_s - completion.unix_s), 3)


def _youngest_by_tier(newest: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    ages: dict[str, float] = {}
    for tiers in newest.values():
        for tier, n in tiers.items():
            ages[tier] = min(ages.get(tier, n["age_s"]), n["age_s"])
    return ages


def _bytes_by_job(slots: list[Any]) -> dict[str, int]:
    held: dict[str, int] = {}
    for s in slots:
        held[s.job] = held.get(s.job, 0) + max(s.size_bytes, s.allocating_bytes)
    return held


def _cluster_status(view: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Return the view's status; the built-in view ("peers") is the peers themselves: not connected while every
    peer is unreachable from here (this node cut off), as an etcd view whose endpoints went quiet."""
    addresses = set(peer.get("peers", {})) | set(peer.get("unreachable", {}))
    if view.get("backend") == "peers" and addresses and addresses <= set(peer.get("unreachable", {})):
        silent = ", ".join(sorted(addresses))
        return {**view, "connected": False, "last_error": f"every peer is unreachable from here: {silent}"}
    return view
