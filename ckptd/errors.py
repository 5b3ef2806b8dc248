"""The daemon's errors that cross a role's border, one class per meaning.

Each derives from ckpt_core.errors.CheckpointError (whose subclasses the RPC edges map to gRPC
status codes), except RootGone, which stops the daemon.
"""

from __future__ import annotations

from ckpt_core.errors import CheckpointError


class ShardWriteError(CheckpointError):
    """Writing a shard to a tier failed; the message names the shard, the tier and the cause."""


class StepAlreadyComplete(ShardWriteError):
    """The step is complete on the tier with other shards: a complete step is never rewritten."""


class StepChanged(CheckpointError):
    """A step is no longer as retention listed it when its removal comes (a rollback's line saved the step number
    again, a write into it began): it stays, and the next pass looks at it afresh."""


class CommitConflict(CheckpointError):
    """A commit record other than ours is already in the object store: it stays, and the step is not ours to commit."""


class LocalCopyGone(CheckpointError):
    """No readable local copy of a shard is left (retention removed it, or a newer save replaced it): no peer or
    store is at fault, and no attempt to send or upload it can succeed."""


class PeerError(CheckpointError):
    """A peer could not be reached, or refused a request; the message names the peer."""


class PeerBusy(PeerError):
    """A node takes as many of its peers' requests of a kind as it can now (replicas being received, data ranges
    offered, cluster calls): the asker backs off and asks again; the node is not down, and it is no failure."""


class AlreadyHeld(CheckpointError):
    """This exact shard is there already (a peer's replica, a shard the store's commit record lists): nothing to
    write, and the copy there is not dropped."""


class NotOffered(CheckpointError):
    """A data connection's ticket names no range offered here (never offered, used already, or expired)."""


class RootGone(Exception):
    """The NVMe root was removed or replaced under the daemon: its view of the steps is void, it stops."""


class MixedLines(CheckpointError):
    """The ranks' shard records of a step name different lines of the job's history (some ranks loaded an older
    step before saving, others did not): the step is never complete. Every rank must load the same step first."""

    def __init__(self, job: str, step: int, lines: list[str]) -> None:
        shown = "; ".join(line or "the first line" for line in lines)
        super().__init__(
            f"{job} step {step} is never complete: its ranks' shards continue different lines of the job ({shown}); "
            "every rank must load the same step (or none) before its next save"
        )


class RemovalRefused(CheckpointError):
    """`ckptd rm` will not remove the step: a role is busy with it, or it is the job's head or pinned (without
    --force). The message says which, and what to do."""
