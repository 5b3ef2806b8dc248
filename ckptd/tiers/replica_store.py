"""The replica store: the copies of other nodes' shards this node keeps, under <root>/.peer, as tier "peer".

A directory tier (tiers.nvme) with one capability more: a single replica retired. The
replica receiver writes into it through its ShardSink; the save path seals and adopts its
steps (its StepCatalog); retention removes steps; the load path reads it as any tier; and
RetireReplica (replication.receiving) removes one replica once its owner holds its own
copy again (remove_shard).
"""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path

from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.format import data_name, meta_name

from ckptd.storage.durable_write import fsync_dir
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.step_records import entry_names


class ReplicaStore(LocalDirTier):
    """Keep replicas of other nodes' shards, step by step, with the NVMe tier's commit protocol."""

    def __init__(self, root: Path, write_threads: Executor | None = None, commit_keys: CommitKeys = UNSIGNED) -> None:
        """write_threads: Executors.replica_writes in a daemon (None: the calling thread, for readers and tests)."""
        super().__init__(root, "peer", write_threads, commit_keys)

    def remove_shard(self, job: str, step: int, rank: int, meta_digest: str) -> bool:
        """Remove one rank's shard from a step, if it is the copy named; the step goes with its last shard.

        Called on a worker thread for RetireReplica (a stand-in's copy, see replication.sending).
        Its record first, so that the shard is unlisted before its data goes.
        """
        step_dir = self._step_dir(job, step)
        with self._step_lock(job, step):
            held = [h for h in self.holdings(job, step) if h.rank == rank and h.meta_digest == meta_digest]
            if not held:
                return False
            (step_dir / meta_name(rank)).unlink(missing_ok=True)
            (step_dir / data_name(rank)).unlink(missing_ok=True)
            self._records.forget(step_dir)
            fsync_dir(step_dir)
            left = [n for n in entry_names(step_dir) if n.startswith("rank-")]
        if not left:
            self.remove_step(job, step)
        return True
