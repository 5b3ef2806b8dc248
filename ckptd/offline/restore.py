"""Copy a step out of a tier into a directory, or check every byte of it, with no daemon.

The offline commands (`ckptd restore`, `verify`, `inspect`, `export`, and `ls` when no daemon
answers) hold tool_threads() around their work: the daemon's thread pools (node.Executors), of
which only those the tiers read and write with start threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path

from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import validate_tier
from ckpt_core.history import History

from ckptd.cluster.peer_inventory import PeerInventory
from ckptd.cluster.peer_link import PeerLink
from ckptd.config import Config
from ckptd.load.fetch import aligned_buffer
from ckptd.node import Executors
from ckptd.operations.status_table import human_size
from ckptd.storage.object_store import open_store
from ckptd.tiers.base import Tier
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object.tier import ObjectTier
from ckptd.tiers.peer import PeerTier
from ckptd.tiers.replica_store import ReplicaStore
from ckptd.tiers.restore_target import DestinationUnwritable, RestoreTarget

Progress = Callable[[str], None]


@contextmanager
def tool_threads() -> Iterator[Executors]:
    """Build the daemon's thread pools for a command with no daemon; shut them down when it is done.

    The daemon's own record, so that a tool reads and writes as the daemon does: its tiers ask on
    inventories, object_reads and object_requests, a restore writes on nvme_writes; the other
    pools never start a thread.
    """
    threads = Executors.build()
    try:
        yield threads
    finally:
        threads.shutdown()


def readable_tiers(config: Config, source: str, threads: Executors) -> list[Tier]:
    """Return the tiers a command can read without a daemon, fastest first, for --from/--tier ("auto": all).

    "peer" reads this node's replica store and, over the peer protocol, the other
    nodes named in [peer] addresses; "object" reads [object] url, and a URL
    (s3://bucket/prefix, file:///dir, ...) reads that object store, with [object] storage_options.
    threads: tool_threads(), where the peer and object tiers ask many things at once.
    """

    def object_tier(url: str) -> ObjectTier:
        store = open_store(url, config.object.storage_options)
        return ObjectTier(store, threads.object_reads, threads.object_requests, commit_keys=config.commit_keys)

    if "://" in source:
        return [object_tier(source)]
    if source not in ("", "auto"):
        validate_tier(source)
    tiers: list[Tier] = [
        MemoryTier.from_directory(config.staging_dir),
        LocalDirTier(config.root, commit_keys=config.commit_keys),
        ReplicaStore(config.replica_root, commit_keys=config.commit_keys),
    ]
    if config.peers:
        names, keys = config.peer_names, config.commit_keys
        links = [PeerLink(a, config.peer, tls_name=names.get(a, ""), commit_keys=keys) for a in config.peers]
        tiers.append(PeerTier(PeerInventory(links, threads.inventories)))
    if config.object.url:
        tiers.append(object_tier(config.object.url))
    if source in ("", "auto"):
        return tiers
    chosen = [t for t in tiers if t.name == source]
    if not chosen:
        off = {"peer": "no [peer] addresses", "object": "no [object] url"}.get(source, "")
        raise NotFound(
            f"tier {source} is off in the config this command read ({off}): give it the daemon's config "
            "(--config PATH or CKPTD_CONFIG)"
            + (", or the store's URL (--tier s3://bucket/prefix)" if source == "object" else "")
        )
    return chosen


def latest_step(tiers: list[Tier], job: str) -> int:
    """Return the job's head on the tiers: the newest step of its newest line (ckpt_core.history)."""
    lines = {s: r.line for t in tiers for s, r in t.complete_records(job).items()}
    head = History.of(lines).head
    if head is None:
        raise NotFound(f"job {job} has no complete step on tier(s) {', '.join(t.name for t in tiers)}")
    return head


def restore(
    tiers: list[Tier], job: str, step: int, target: Path, progress: Progress, write_threads: Executor | None = None
) -> Path:
    """Copy every shard of a complete step from the first tier holding a good copy into target/<job>/<step>/.

    write_threads: the target's writers, as the NVMe tier's in a daemon (tool_threads().nvme_writes;
    None writes on the calling thread).
    """
    return _restore(tiers, job, step, RestoreTarget(target, write_threads), progress)


def _restore(tiers: list[Tier], job: str, step: int, out: RestoreTarget, progress: Progress) -> Path:
    step_dir = out.step_dir(job, step)
    if out.holds_step(job, step):
        raise CheckpointError(f"{step_dir} already exists; restore into an empty place")
    if step_dir.exists():  # no commit record: what a restore that was killed left
        progress(f"{step_dir}: removing what an earlier restore, cut short, left there")
        out.clear(job, step)
    # Every tier that knows the step as complete may hold some of its ranks: a step spread
    # over nodes has part of its shards here and the rest on the peers.
    holders = [t for t in tiers if _knows(t, job, step)]
    if not holders:
        raise NotFound(f"{job} step {step} is not complete on tier(s) {', '.join(t.name for t in tiers)}")
    # One commit record for the whole step: a tier whose record differs holds another save
    # of the step (a rerun of the job), and its shards must not be mixed in.
    record = holders[0].commit_record(job, step)
    for other in [t for t in holders[1:] if t.commit_record(job, step) != record]:
        progress(f"{other.name} holds a different save of {job} step {step} than {holders[0].name}: not used")
        holders.remove(other)
    world_size = record.world_size
    try:
        out.begin(job, step)
        for rank in range(world_size):
            errors = []
            for tier in holders:
                try:
                    meta = tier.read_meta(job, step, rank)
                    progress(
                        f"rank {rank}/{world_size}: reading {human_size(meta.data_size_bytes)} from {tier.name} ..."
                    )
                    started = time.monotonic()
                    with aligned_buffer(meta.data_size_bytes) as buf:
                        tier.read_into(meta, buf)
                        out.write(meta, buf)
                    rate = meta.data_size_bytes / max(time.monotonic() - started, 1e-9) / 1e6
                    progress(
                        f"rank {rank}/{world_size}: {meta.data_size_bytes} bytes from {tier.name}, verified "
                        f"({rate:.0f} MB/s)"
                    )
                    break
                except DestinationUnwritable:
                    raise  # the same for every tier: no other copy can help
                except (CheckpointError, OSError) as e:
                    progress(f"rank {rank}/{world_size}: {e}; trying the next tier")
                    errors.append(str(e))
            else:
                raise CorruptCheckpoint(f"no good copy of rank {rank} of {job} step {step}: " + "; ".join(errors))
        out.seal(job, step, world_size)
    except BaseException:
        out.clear(job, step)  # nothing half-restored is left to trip the next attempt
        raise
    return step_dir


def _knows(tier: Tier, job: str, step: int) -> bool:
    try:
        tier.commit_record(job, step)
    except CheckpointError:
        return False
    return True
