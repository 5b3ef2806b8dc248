"""ckpt: asynchronous multilevel checkpoints for PyTorch training, through the local ckptd.

    c = ckpt.Checkpointer(job="llama", rank=rank, world_size=world_size)
    h = c.save_async(state)        # returns after one copy into shared memory
    h.wait("nvme")                 # optional: block until durable on local NVMe
    state = c.load()               # latest complete step, fastest verified tier

The module-level functions use one default Checkpointer built from the
environment (CKPT_JOB, CKPTD_ADDRESS, and the launcher's rank and world size:
ckpt.launcher) on first use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ckpt_core._version import __version__
from ckpt_core.errors import (
    CheckpointError,
    CorruptCheckpoint,
    DaemonUnavailable,
    InvalidArgument,
    NotFound,
    ReservationLost,
    SaveFailed,
    SaveSkipped,
    UnsafeCheckpoint,
)

from ckpt.key_filter import LoadReport
from ckpt.torch_version import require_torch

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpoint",
    "DaemonUnavailable",
    "InvalidArgument",
    "LoadReport",
    "NotFound",
    "ReservationLost",
    "SaveFailed",
    "SaveHandle",
    "SaveSkipped",
    "UnsafeCheckpoint",
    "__version__",
    "init",
    "latest_step",
    "load",
    "load_local",
    "save_async",
]

if TYPE_CHECKING:
    from ckpt.checkpointer import Checkpointer, SaveHandle
    from ckpt.local_read import load_local

_LAZY = {"Checkpointer", "SaveHandle", "load_local"}
_default: Checkpointer | None = None


def __getattr__(name: str) -> Any:
    # torch is imported only when the training-side API is used, so the daemon can
    # import ckpt_core.format and ckpt_core.shard_io without it.
    if name in _LAZY:
        require_torch()
        from ckpt import checkpointer, local_read

        return getattr(local_read if name == "load_local" else checkpointer, name)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")


def init(
    job: str | None = None, rank: int | None = None, world_size: int | None = None, address: str | None = None
) -> Checkpointer:
    """Create (or replace) the default Checkpointer used by the module-level functions."""
    global _default
    from ckpt.checkpointer import Checkpointer

    if _default is not None:
        _default.close()
    _default = Checkpointer(job=job, rank=rank, world_size=world_size, address=address)
    return _default


def _checkpointer() -> Checkpointer:
    return _default if _default is not None else init()


def save_async(state: Any, step: int | None = None, lazy: bool = False) -> SaveHandle:
    """Snapshot state with the default Checkpointer; see Checkpointer.save_async."""
    return _checkpointer().save_async(state, step, lazy)


def load(
    step: int | None = None,
    map_location: Any = "cpu",
    tier: str = "auto",
    into: Any = None,
    strict: bool = True,
    keys: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    weights_only: bool = False,
) -> Any:
    """Load with the default Checkpointer; see Checkpointer.load."""
    return _checkpointer().load(step, map_location, tier, into, strict, keys, exclude, weights_only)


def latest_step() -> int | None:
    """Return the default Checkpointer's latest complete step; see Checkpointer.latest_step."""
    return _checkpointer().latest_step()
