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


class UnsafeCheckpoint(CheckpointError):
    """A step holds a value that a restricted load (weights_only=True) does not unpickle: global_name names it."""

    def __init__(self, what: str, global_name: str) -> None:
        super().__init__(what, global_name)  # as its args, so the error pickles and compares as any other
        self.what = what
        self.global_name = global_name

    def __str__(self) -> str:
        return (
            f"{self.what} holds {self.global_name}, which a load with weights_only=True does not unpickle "
            "(torch.load(weights_only=True)'s allow-list): if you trust this checkpoint, load it with "
            "weights_only=False, or allow that one global with "
            f"torch.serialization.add_safe_globals([{self.global_name}])"
        )
