"""`ckptd gc --job J --all`: a finished job leaves this node, its staging slots first, then its steps on every tier.

One JobRemoval per daemon, built by the composition root (node.py); the Collect RPC's
servicer (rpc/server.py) calls remove() on the event loop. The steps go through retention
(RetentionRunner.remove_job, which asks the save path to remove each), the slots through
idle release; then the roles that remember the job forget it.
"""

from __future__ import annotations

from ckpt_core.errors import InvalidArgument

from ckptd.cluster.view import ClusterView
from ckptd.operations.idle_release import IdleRelease
from ckptd.operations.job_retention import JobRetention
from ckptd.operations.retention import BusySteps, Removal, RetentionRunner
from ckptd.save.progress import ShardProgress


class JobRemoval:
    """Remove a finished job from this node, and make every role of it forget the job."""

    def __init__(
        self,
        receiver: BusySteps,
        idle_release: IdleRelease,
        retention: RetentionRunner,
        progress: ShardProgress,
        job_retention: JobRetention,
        view: ClusterView | None,
    ) -> None:
        """receiver: the replica receiver (what it is receiving holds the job here)."""
        self._receiver = receiver
        self._idle_release = idle_release
        self._retention = retention
        self._progress = progress
        self._job_retention = job_retention
        self._view = view

    async def remove(self, job: str, dry_run: bool, object_too: bool) -> list[Removal]:
        """Remove the job's slots, then its steps from NVMe and the replica store (and the object store: object_too).

        Refused (InvalidArgument) while replicas of the job are still arriving, or a rank of it still saves.
        """
        receiving = sorted({step for j, step in self._receiver.busy_steps() if j == job})
        if receiving:  # its files would go under the writes, and the sender's seal would find nothing
            raise InvalidArgument(f"job {job} is still receiving replicas of steps {receiving} on this node: wait")
        slots = await self._idle_release.remove(job, dry_run)  # refuses a job still saving
        removals = [Removal("memory", job, s.shard.step, f"rank {s.rank}'s staging slot") for s in slots if s.shard]
        tiers = ("nvme", "peer", "object") if object_too else ("nvme", "peer")
        removals += await self._retention.remove_job(job, dry_run, tiers)
        if not dry_run:  # `status` and /metrics stop reporting its newest steps there, nor the cluster view
            self._progress.forget_job(job, ("memory", *tiers))
            await self._job_retention.forget(job)  # its pins and its client's settings
            if self._view is not None:
                await self._view.forget_job(job)
        return removals
