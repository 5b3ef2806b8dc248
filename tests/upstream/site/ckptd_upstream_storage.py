"""Point torch.distributed.checkpoint's file-system storage at ckptd, for PyTorch's own DCP tests.

install() swaps FileSystemWriter and FileSystemReader, wherever DCP's modules hold them, for
ckpt.dcp.Writer and Reader on a job named after the path (a path becomes a job: every save to
it is the job's next step, a load reads its latest complete step), and routes a bare
checkpoint_id path (dcp.save(sd, checkpoint_id=path)) to the same. The daemon is the one at
CKPTD_ADDRESS. Storage options ckptd has no use for (thread_count, _extensions, overwrite,
cache_staged_state_dict, sync_files...) are accepted and dropped: ckptd decides how it writes.
The swap is live only while `active` is true (tests/upstream/conftest.py sets it around each
upstream test; other tests of the same run get DCP as it is), and in the processes an upstream
test spawns, which install it through sitecustomize.py in this directory.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import ckpt.dcp
import torch.distributed.checkpoint._storage_utils as storage_utils
import torch.distributed.checkpoint.filesystem as filesystem
import torch.distributed.checkpoint.format_utils  # noqa: F401 - loaded, so that install() swaps its names too
import torch.distributed.checkpoint.state_dict_loader as loader
import torch.distributed.checkpoint.state_dict_saver as saver
from ckpt.dcp_writer import checkpoint_step

STOCK_WRITER = filesystem.FileSystemWriter
STOCK_READER = filesystem.FileSystemReader
_stock_storage_setup = storage_utils._storage_setup
active = False


def job_of(path: str | os.PathLike[str]) -> str:
    """Return the ckptd job that stands for a checkpoint directory (its absolute path, hashed)."""
    digest = hashlib.sha256(os.path.abspath(os.fspath(path)).encode()).hexdigest()[:24]
    return f"upstream-{digest}"


def _is_path(checkpoint_id: object) -> bool:
    return isinstance(checkpoint_id, str | os.PathLike) and checkpoint_step(checkpoint_id) is None


class CkptdFileSystemWriter(ckpt.dcp.Writer):
    """FileSystemWriter(path, ...) as a ckpt.dcp.Writer on the job job_of(path) (the stock one when not active)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__new__(cls) if active else STOCK_WRITER(*args, **kwargs)

    def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(job=job_of(path))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # A path names the job (fixed at construction), not a step: the save is the job's next step.
        super().reset(None if _is_path(checkpoint_id) else checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True if active else STOCK_WRITER.validate_checkpoint_id(checkpoint_id)


class CkptdFileSystemReader(ckpt.dcp.Reader):
    """FileSystemReader(path, ...) as a ckpt.dcp.Reader of job_of(path)'s latest step (stock when not active)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__new__(cls) if active else STOCK_READER(*args, **kwargs)

    def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(job=job_of(path))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(None if _is_path(checkpoint_id) else checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True if active else STOCK_READER.validate_checkpoint_id(checkpoint_id)


def _storage_setup(storage: Any, checkpoint_id: Any, reader: bool = False) -> Any:
    """Give a bare checkpoint_id path the ckptd storage of its job; anything else as DCP would."""
    if active and storage is None and _is_path(checkpoint_id):
        return (CkptdFileSystemReader if reader else CkptdFileSystemWriter)(checkpoint_id)
    return _stock_storage_setup(storage, checkpoint_id, reader)


def install(activate: bool = False) -> None:
    """Swap DCP's file-system storage for ckptd's in every DCP module loaded now (call before the tests import)."""
    global active
    active = active or activate
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed.checkpoint") or module is filesystem:
            continue
        if getattr(module, "FileSystemWriter", None) is STOCK_WRITER:
            module.FileSystemWriter = CkptdFileSystemWriter
        if getattr(module, "FileSystemReader", None) is STOCK_READER:
            module.FileSystemReader = CkptdFileSystemReader
    for module in (storage_utils, saver, loader):
        module._storage_setup = _storage_setup
