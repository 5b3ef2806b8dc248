"""Copy a shard from one tier to another, verified: how a node gets back a shard it lacks.

The locate role calls fetch_shard from its fetch threads (a shard from the peers or
the object store onto NVMe); restore and verify borrow aligned_buffer. Calls block.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager

from ckpt_core.errors import CheckpointError
from ckpt_core.format import DIRECT_IO_ALIGN_BYTES, ShardMeta, round_up

from ckptd.tiers.base import DurableTier, Tier


def fetch_shard(source: Tier, target: DurableTier, job: str, step: int, rank: int, replace: bool = False) -> ShardMeta:
    """Copy a rank's shard of a complete step from source onto target, verified, and seal the step there.

    Every byte is read and checked even when target holds that exact shard already:
    then it is written again only with replace (target's copy failed its checks).
    """
    record = source.commit_record(job, step)
    meta = source.read_meta(job, step, rank)
    with aligned_buffer(meta.data_size_bytes) as buffer:
        source.read_into(meta, buffer)
        if replace or not target.holds(meta):
            target.write_shard(meta, buffer)
    if not target.adopt_commit(record):
        raise CheckpointError(
            f"{job} step {step} rank {rank}: fetched from {source} and written to {target}, which did not seal it "
            "(the step was removed there meanwhile, or holds another commit record): try again"
        )
    return meta


@contextmanager
def aligned_buffer(size_bytes: int) -> Iterator[memoryview]:
    """Lend a page-aligned buffer of at least size_bytes, rounded up for direct I/O."""
    with mmap.mmap(-1, max(round_up(size_bytes, DIRECT_IO_ALIGN_BYTES), DIRECT_IO_ALIGN_BYTES)) as m:
        view = memoryview(m)
        try:
            yield view
        finally:
            view.release()
