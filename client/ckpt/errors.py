"""Exceptions raised by ckpt and ckptd; every one names what went wrong and where."""


class CheckpointError(Exception):
    """Base class of every error ckpt raises on purpose."""


class InvalidArgument(CheckpointError, ValueError):
    """A job name, step, rank, path or state that cannot be checkpointed."""


class DaemonUnavailable(CheckpointError):
    """The local ckptd cannot be reached."""


class NotFound(CheckpointError):
    """No complete step matches the request."""


class CorruptCheckpoint(CheckpointError):
    """Bytes on a tier do not match their checksums."""


class SaveFailed(CheckpointError):
    """A shard could not reach the tier a caller waited for."""


class SaveSkipped(CheckpointError):
    """A save was skipped under staging policy "skip"."""


class ReservationLost(CheckpointError):
    """The staging slot reserved for a save was taken back (the daemon restarted, or the rank saved again)."""
