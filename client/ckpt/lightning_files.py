"""Lightning's checkpoint paths as torch.save files, written in the background from durable ckptd steps.

CkptdCheckpointIO writes a pointer at a Lightning path when save_checkpoint returns
(ckpt.lightning), and hands the path to a TorchFileWriter. Its thread waits until the
step is durable on NVMe, reads it from the daemon's NVMe root itself (ckpt.load_local,
every chunk checked: a load through the daemon would keep retention off the step for
its read lease, 10 minutes, and so every step of a job that saves more often than that),
and writes torch.save of the checkpoint dict, with the pointer's JSON under POINTER_KEY, to
path.torch.partial, then renames it over the pointer, unless the path was saved again
or removed meanwhile (then the work is dropped). So torch.load, pl_load and
LightningModule.load_from_checkpoint open the path once its step is durable and the
file written, and the plugin still reads the step from ckptd's fastest tier, finding
the pointer inside the file with pointer_text, which reads only the file's pickle.

Who calls what, on which thread: write_after and forget on the training thread
(save_checkpoint, remove_checkpoint); the writes on one daemon thread,
"ckpt-lightning-files", in the order given; close on the thread that tears the plugin down
(Lightning's training thread; AsyncCheckpointIO's after a save there) or at interpreter exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
import zipfile
from typing import IO, Any

import torch
from ckpt_core.errors import CheckpointError, SaveSkipped
from lightning.fabric.utilities.cloud_io import get_filesystem

from ckpt.background import BackgroundThread
from ckpt.checkpointer import Checkpointer, SaveHandle
from ckpt.local_read import load_local

log = logging.getLogger(__name__)

# The key of a torch file written here that holds its pointer (JSON text, as a pointer file holds it).
POINTER_KEY = "ckptd"
# How long the writer waits for a step to become durable: a flush takes seconds to minutes; beyond this,
# something is stuck, and the path keeps its pointer.
DURABLE_WAIT_S = 600.0
# How often a wait for a step looks whether its file is still wanted.
WANTED_CHECK_S = 1.0
# A torch file's pickle larger than this is not read for a pointer (its tensors are elsewhere in the archive).
MAX_PICKLE_BYTES = 64 << 20


class TorchFileWriter:
    """Replace the pointers at Lightning paths with torch.save files of their steps, once each is durable."""

    def __init__(self, job: str, address: str | None) -> None:
        self._job = job
        self._address = address
        self._thread = BackgroundThread("ckpt-lightning-files")
        self._lock = threading.Lock()  # orders renames here against new pointers and removals there
        self._wanted: dict[str, object] = {}  # path -> the token of the last write asked for it
        self._waits: Checkpointer | None = None  # its handles wait for durability; opened on the writer's thread
        self._nvme_root: str | None = None  # the daemon's, asked once
        self._failure: CheckpointError | None = None  # the first file that could not be written
        self._closed = False

    def write_after(self, path: str, pointer_json: bytes, step: int) -> None:
        """Ask for a torch file at path once step is durable; call before the pointer is written there."""
        token = object()
        with self._lock:
            self._wanted[path] = token
        self._thread.submit(self._write, path, token, pointer_json, step)

    def forget(self, path: str) -> None:
        """Drop the write asked for path, if it has not replaced the pointer yet; call before removing path."""
        with self._lock:
            self._wanted.pop(path, None)

    def close(self, wait: bool = True) -> None:
        """Finish the writes asked for (wait=False: drop them), close the reader, raise the first failure."""
        if self._closed:
            return
        self._closed = True
        if not wait:
            with self._lock:
                self._wanted.clear()
        self._thread.close()
        if self._waits is not None:
            self._waits.close()
        if self._failure is not None and wait:
            raise self._failure

    def _write(self, path: str, token: object, pointer_json: bytes, step: int) -> None:
        """Write one torch file (the writer's thread); a failure is logged and kept for close()."""
        if not self._still_wanted(path, token):
            return
        fs = get_filesystem(path)
        partial = f"{path}.torch.partial"
        try:
            checkpoint = self._durable(step, path, token)
            if checkpoint is None or not self._still_wanted(path, token):
                return
            with fs.open(partial, "wb") as f:
                torch.save({**checkpoint, POINTER_KEY: pointer_json.decode()}, f)
                _sync(f)
            del checkpoint
            with self._lock:
                if self._wanted.get(path) is token:
                    fs.mv(partial, path)
                    del self._wanted[path]
                    return
        except (CheckpointError, OSError) as e:
            log.warning("ckpt: %s keeps its pointer to step %d of %s: no torch file: %s", path, step, self._job, e)
            if self._failure is None:
                self._failure = CheckpointError(f"the torch file at {path} (step {step} of {self._job}): {e}")
        with contextlib.suppress(OSError):
            fs.rm(partial)

    def _still_wanted(self, path: str, token: object) -> bool:
        with self._lock:
            return self._wanted.get(path) is token

    def _durable(self, step: int, path: str, token: object) -> dict[str, Any] | None:
        """Wait until step is durable on NVMe and return its checkpoint dict, or None if the file is not to be.

        None: the step never will be durable, or the path's write was dropped meanwhile (looked at
        every WANTED_CHECK_S, so that a teardown that waits for no file does not wait for this).
        """
        if self._waits is None:
            self._waits = Checkpointer(job=self._job, rank=0, world_size=1, address=self._address)
        handle = SaveHandle(self._waits, step, skipped=False, blocked_s=0.0, reason="")
        deadline = time.monotonic() + DURABLE_WAIT_S
        while True:
            try:
                handle.wait("nvme", WANTED_CHECK_S)
                break
            except SaveSkipped as e:  # a newer snapshot passed it over: the path names a step NVMe never had
                log.info("ckpt: step %d of %s was passed over on NVMe: no torch file for it: %s", step, self._job, e)
                return None
            except TimeoutError:
                if not self._still_wanted(path, token):
                    return None
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"step {step} of {self._job} did not reach nvme in {DURABLE_WAIT_S:.0f} s"
                    ) from None
        if self._nvme_root is None:
            self._nvme_root = str(self._waits.daemon.status()["tiers"]["nvme"]["root"])
        checkpoint: dict[str, Any] = load_local(os.path.join(self._nvme_root, self._job, str(step)))
        return checkpoint


def pointer_text(f: IO[bytes]) -> bytes | None:
    """Return the pointer JSON a torch file written here carries, None for any other file; reads only its pickle."""
    try:
        archive = zipfile.ZipFile(f)
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1 or archive.getinfo(names[0]).file_size > MAX_PICKLE_BYTES:
            return None
        top = _Skeleton(archive.open(names[0])).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
        return None
    text = top.get(POINTER_KEY) if isinstance(top, dict) else None
    return text.encode() if isinstance(text, str) else None


class _Opaque:
    """Whatever a torch file's pickle builds (tensors, classes): taken in and ignored, so no code of it runs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque()

    def __setstate__(self, state: Any) -> None:
        return

    def __setitem__(self, key: Any, value: Any) -> None:
        return

    def append(self, value: Any) -> None:
        return

    def extend(self, values: Any) -> None:
        return


class _Skeleton(pickle.Unpickler):
    """Unpickle the plain containers and values of a torch file's pickle; every class and storage is an _Opaque."""

    def find_class(self, module: str, name: str) -> Any:
        return _Opaque

    def persistent_load(self, pid: Any) -> Any:
        return _Opaque()


def _sync(f: Any) -> None:
    """Flush a local file to its disk before it replaces the pointer (remote files are whole when closed)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        f.flush()
        os.fsync(f.fileno())
