"""The directory a step is restored into (`ckptd restore --to`): its own small thing, not a mode of a tier.

offline.restore calls, on its thread, for one step: holds_step() (refused if the step is
there), clear() (what a restore cut short left), begin() (the step's directory), write() for
each rank's shard it read and checked on a tier, then seal(); clear() again on any failure.
The shards go in through a directory tier's ShardSink (the one write path, the NVMe tier's
commit protocol); every disk error is DestinationUnwritable: the bytes were good, only the
destination failed, and no other tier's copy can help.
"""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path

from ckpt_core.errors import CheckpointError
from ckpt_core.format import ShardMeta

from ckptd.errors import ShardWriteError
from ckptd.tiers.nvme import LocalDirTier


class DestinationUnwritable(CheckpointError):
    """The restore destination (--to) cannot be written: no tier's copy is at fault, and no other tier helps."""


class RestoreTarget:
    """Write one complete step into <root>/<job>/<step>/, shard by shard, sealed by its commit record last."""

    def __init__(self, root: Path, write_threads: Executor | None = None) -> None:
        """write_threads: where a shard's blocks are written, several at once (tool_threads().nvme_writes, as the
        NVMe tier's in a daemon); None writes them on the calling thread."""
        self.root = root
        self._dir = LocalDirTier(root, name="restore", write_threads=write_threads)

    def step_dir(self, job: str, step: int) -> Path:
        """Return the directory the step is restored into."""
        return Path(self._dir.shard_source(job, step, 0).path)

    def holds_step(self, job: str, step: int) -> bool:
        """Say whether the step is restored here already (its commit record is there and checks)."""
        return self._dir.is_complete(job, step)

    def clear(self, job: str, step: int) -> None:
        """Remove what a restore of the step that was cut short, or failed, left: nothing half-restored stays."""
        if self.step_dir(job, step).exists():
            self._dir.remove_step(job, step)

    def begin(self, job: str, step: int) -> None:
        """Make the step's directory; raise DestinationUnwritable if the destination cannot be written."""
        try:
            self.step_dir(job, step).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._unwritable(e.strerror or e) from None

    def write(self, meta: ShardMeta, data: memoryview) -> None:
        """Write a shard read and checked on a tier; a disk error here is the destination's, not the tier's."""
        try:
            self._dir.write_shard(meta, data)
        except ShardWriteError as e:
            if isinstance(e.__cause__, OSError):  # the bytes were in memory: only the destination's disk failed
                raise self._unwritable(e) from e
            raise

    def seal(self, job: str, step: int, world_size: int) -> None:
        """Write the step's commit record once every rank's shard is in; raise if one is missing."""
        try:
            committed = self._dir.try_commit(job, step, world_size)
        except OSError as e:
            raise self._unwritable(e.strerror or e) from e
        if committed is None:
            raise CheckpointError(f"{self.step_dir(job, step)}: not every shard was written")

    def _unwritable(self, why: object) -> DestinationUnwritable:
        return DestinationUnwritable(f"cannot write the restore destination {self.root}: {why}")
