"""A PyTorch Lightning CheckpointIO on ckptd: Trainer(plugins=[ckpt.lightning.CkptdCheckpointIO(job="run-7")]).

Lightning keeps its checkpoints as files at paths: ModelCheckpoint names them, lists
its dirpath, removes the files that drop out of its top k, and resolves
ckpt_path="last" by looking for last*.ckpt there. This plugin keeps that bookkeeping
and moves the bytes into ckptd. save_checkpoint stages the checkpoint dict with
Checkpointer.save_async and, once it is committed in ckptd's shared memory (when
save_async returns: from then on ckptd holds the step), writes a pointer of a few
bytes at the path Lightning asked for (Pointer: JSON naming the job and step).
Once the step is durable on NVMe, a background thread replaces the pointer with a
torch.save file of the checkpoint that carries the pointer under the key "ckptd"
(ckpt.lightning_files), so that torch.load, pl_load, LightningModule.load_from_checkpoint
and a Trainer without this plugin open the path; torch_files=False keeps the pointers.
load_checkpoint reads the pointer (from either file) and loads that step from the
fastest tier holding a good copy (waiting, if need be, the moment the daemon takes to
checksum a fresh copy), or, if ckptd holds the step no more, the torch file itself.
remove_checkpoint removes the file; the step's bytes are ckptd's retention's to keep
or drop.

The ckptd step of a checkpoint is Lightning's global_step, unless this plugin saved that
step already with other tensors (then it is one past the step it saved last: ckptd never
rewrites a step). The pointer records both. The job's history is ckptd's (docs/DESIGN.md,
"A job's history"): a run resumed from an older checkpoint loads it through the plugin's
Checkpointer, so its saves start a new line from it and the old run's later steps become
superseded. A new run in a used job (a plugin that saves before it loaded a checkpoint of
the job, as a new Trainer in a used directory does) is versioned as Lightning versions its
files: its saves go to the job's first version not used yet, JOB-v1, JOB-v2, ..., and a
warning names it; a run resumed from a checkpoint of any version continues that version.
A save of the global_step saved last whose tensors are the same tensors, none changed
in place since (Fingerprint), writes only another pointer to the same step: so
ModelCheckpoint's top-k file and last.ckpt of one step are one ckptd step, as with
ModelCheckpoint(save_last="link"), and their values other than tensors (the callback's
last_model_path) are the first save's.

Who calls what, in which order, on which thread: Lightning's Strategy calls
save_checkpoint and remove_checkpoint on global rank 0 alone, on the training thread;
load_checkpoint on every rank when a run resumes (Trainer.fit(ckpt_path=...)); teardown
on every rank at the end of each fit, validate, test and predict. The whole state is
rank 0's, so a ckptd step holds it as the one rank of a world of one (rank 0,
world_size 1), however many ranks train, and every rank loads that shard.

FSDPStrategy and ModelParallelStrategy do not go through here for sharded state: they
write torch.distributed.checkpoint directories themselves. FSDPStrategy's full state
dicts do reach save_checkpoint (rank 0), but its load_checkpoint reads the path with
torch itself, so it resumes from the torch file once it is written, never from a pointer.

A plugin given no job (no job= and no CKPT_JOB) loads: the pointer names the job, and the
plugin takes it for its later saves. storage_options are accepted and ignored (logged once).
Lightning's AsyncCheckpointIO may wrap the plugin (it gains nothing: a save returns after one
copy already), but does not call its teardown: the plugin's threads are daemon threads, and its
files are written and its connection closed when the plugin goes or the interpreter exits.

A save through Trainer.save_checkpoint outside the Trainer's fit loop (after fit, in validate, or
called by hand) overlaps no training, and one on AsyncCheckpointIO's thread blocks no training: each
is a step of its own, and returns only once the file at its path is the torch file (with teardown_tier
"nvme"), after which the plugin is torn down, so that no thread of it is left behind. Saves inside the
fit loop (ModelCheckpoint's), and any other (Fabric's, a direct call), return at once.

A dict without global_step is not a Trainer checkpoint (Lightning's ddp_spawn hands
the final weights to the main process in a temporary file this way): it is written
and read with torch.save and torch.load, as TorchCheckpointIO does, and so is a
checkpoint path that holds a file other than a pointer.

Importing this module imports lightning; `import ckpt` does not.
"""

from __future__ import annotations

from ckpt.torch_version import require_torch

require_torch()

import contextlib  # noqa: E402 (torch checked first)
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.fabric.utilities.types import _PATH
except ImportError as e:  # ckptd-client does not depend on Lightning: say what to install
    raise ImportError(f"ckpt.lightning needs PyTorch Lightning (pip install 'lightning>=2.6'): {e}") from e

from ckpt_core.daemon_socket import resolve_address  # noqa: E402
from ckpt_core.errors import CheckpointError, InvalidArgument, NotFound, SaveFailed  # noqa: E402
from ckpt_core.format import validate_job, validate_step  # noqa: E402

from ckpt.checkpointer import Checkpointer, SaveHandle  # noqa: E402
from ckpt.flatten import flatten  # noqa: E402
from ckpt.job_versions import new_run_job  # noqa: E402
from ckpt.lightning_files import POINTER_KEY, TorchFileWriter, pointer_text  # noqa: E402
from ckpt.pointer_file import broken_pointer, pointer_bytes, pointer_fields  # noqa: E402

log = logging.getLogger(__name__)

POINTER_FORMAT = "ckptd-lightning-pointer"
POINTER_VERSION = 1
MAX_POINTER_BYTES = 4096
# What teardown may wait for: tiers every save reaches (replication and uploads may pass steps over).
TEARDOWN_TIERS = ("memory", "nvme")
# How long a load waits for a step ckptd holds in memory but has not checksummed yet (a flush takes
# seconds to minutes): beyond this, something is stuck, and saying so beats hanging.
FLUSH_WAIT_S = 600.0
# A checkpoint's tensors as (address, version counter, dtype, shape, strides, device), in order.
Fingerprint = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class Pointer:
    """What a checkpoint path holds: which ckptd job and step hold the checkpoint, as one small JSON object."""

    job: str
    step: int
    global_step: int  # Lightning's, for people reading the file: the step may differ (see the module docstring)
    address: str  # the daemon the step was saved through, for people and errors: loads use the plugin's

    def to_json(self) -> bytes:
        """Return the pointer as the bytes of its file."""
        return pointer_bytes(POINTER_FORMAT, POINTER_VERSION, asdict(self))

    @classmethod
    def from_json(cls, data: bytes, path: str) -> Pointer:
        """Parse a pointer file's bytes, or raise InvalidArgument naming path."""
        fields = pointer_fields(data, path, POINTER_FORMAT, POINTER_VERSION)
        with broken_pointer(path):
            if not isinstance(fields["address"], str):
                raise InvalidArgument(f"address {fields['address']!r} is not a string")
            return cls(
                validate_job(fields["job"]),
                validate_step(fields["step"]),
                validate_step(fields["global_step"]),
                fields["address"],
            )


def read_pointer(path: str) -> Pointer | None:
    """Return the pointer at path, in a pointer file or in a torch file this plugin wrote; None for another file.

    A missing path raises FileNotFoundError with TorchCheckpointIO's message.
    """
    return _read_path(path)[0]


def _read_path(path: str) -> tuple[Pointer | None, bool]:
    """Return the pointer at path (or None) and whether path holds a file torch.load reads."""
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")  # as TorchCheckpointIO says it
    with fs.open(path, "rb") as f:
        head = f.read(MAX_POINTER_BYTES + 1)
        if not head.lstrip().startswith(b"{"):
            f.seek(0)
            text = pointer_text(f)
            return (Pointer.from_json(text, path) if text is not None else None), True
    if len(head) > MAX_POINTER_BYTES:
        raise InvalidArgument(f"{path} is not a ckptd pointer: it is larger than {MAX_POINTER_BYTES} bytes")
    return Pointer.from_json(head, path), False


def write_pointer(path: str, pointer: Pointer) -> None:
    """Write a pointer at path, whole or not at all: into path.partial, then renamed over path."""
    fs = get_filesystem(path)
    if os.path.dirname(path):
        fs.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial"
    with fs.open(partial, "wb") as f:
        f.write(pointer.to_json())
    fs.mv(partial, path)


class CkptdCheckpointIO(CheckpointIO):
    """Save Lightning checkpoints into ckptd with pointers to them at Lightning's paths, and load them back.

    job names the ckptd job (default: env CKPT_JOB; without either, the plugin only loads,
    and takes the job of the first pointer it loads); address the daemon (default: env
    CKPTD_ADDRESS, else the default socket). save_checkpoint returns once the checkpoint
    is copied into ckptd's shared memory and its pointer written; the daemon makes it
    durable, and then, with torch_files (the default), a background thread replaces the
    pointer with a torch.save file of the step that still names it (ckpt.lightning_files).
    A save that failed in the background (a full disk, say) is raised by the next
    save_checkpoint, or by teardown, which first waits until every save has reached
    teardown_tier ("nvme", the default, and the torch files written; "memory" waits for
    nothing more, and drops the torch files not written yet), so that the process may
    exit; a save that blocks no training (outside fit, or on AsyncCheckpointIO's thread)
    returns only once its file is written, as the module's docstring says. One thread at a
    time calls the methods (Lightning's training thread, and AsyncCheckpointIO's for saves);
    the module's docstring says in which order.
    """

    def __init__(
        self,
        job: str | None = None,
        address: str | None = None,
        teardown_tier: str = "nvme",
        torch_files: bool = True,
    ) -> None:
        super().__init__()
        job = job if job is not None else os.environ.get("CKPT_JOB", "")
        if teardown_tier not in TEARDOWN_TIERS:
            raise InvalidArgument(f"teardown_tier must be one of {', '.join(TEARDOWN_TIERS)}, not {teardown_tier!r}")
        self.job: str | None = validate_job(job) if job else None  # the job saved to: job= or a version of it
        self._base_job = self.job  # job= (or the first pointer loaded): the name its versions are made from
        self._job_settled = False  # whether self.job is this run's: set by the first save, or by a load of it
        self.address = address
        self.teardown_tier = teardown_tier
        self.torch_files = bool(torch_files)
        self._files = TorchCheckpointIO()  # dicts that are not Trainer checkpoints, paths that hold no pointer
        self._checkpointer: Checkpointer | None = None  # opened by the first save after each teardown
        self._torch_files: TorchFileWriter | None = None  # likewise
        self._at_exit: list[weakref.finalize] = []  # closes both if teardown never comes; dropped by teardown
        self._in_flight: list[SaveHandle] = []  # saves not known to have reached teardown_tier (pruned at each save)
        self._last: tuple[Pointer, Fingerprint | None] | None = None  # the last save, and its tensors
        self._ignored_storage_options = False  # said once

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Stage checkpoint into ckptd and write a pointer to it at path; return without waiting for durability.

        storage_options (Trainer.save_checkpoint's) is accepted and ignored: where the bytes go, and how, is
        the ckptd daemon's configuration; anything in it is logged once as ignored.
        """
        if storage_options and not self._ignored_storage_options:
            self._ignored_storage_options = True
            log.warning(
                "ckpt: storage_options %r ignored: where ckptd keeps checkpoints is the daemon's configuration",
                storage_options,
            )
        global_step = checkpoint.get("global_step")
        if global_step is None:
            log.info("ckpt: %s holds no global_step, so not a Trainer checkpoint: writing it with torch.save", path)
            self._files.save_checkpoint(checkpoint, path)
            return
        if self.job is None:
            raise InvalidArgument(f"{type(self).__name__} needs a ckptd job name to save: pass job=... or set CKPT_JOB")
        _refuse_other_ranks()
        self._raise_failures()
        tensors = fingerprint(checkpoint)
        last = self._last
        finish = _overlaps_no_training()
        if finish:
            tensors = None  # a step of its own: values besides the tensors (epoch, callbacks) moved on since
        if last is not None and last[0].global_step == global_step and tensors is not None and last[1] == tensors:
            pointer: Pointer | None = last[0]  # the same state again: another pointer to its step
        else:
            pointer = self._save(checkpoint, validate_step(global_step), str(path), tensors)
        if pointer is not None:
            if self.torch_files:
                self._file_writer().write_after(str(path), pointer.to_json(), pointer.step)
            write_pointer(str(path), pointer)
        if finish:
            self.teardown()  # its file is written before it returns, and no thread is left

    def _save(
        self, checkpoint: dict[str, Any], global_step: int, path: str, tensors: Fingerprint | None
    ) -> Pointer | None:
        """Stage one checkpoint as a new step of the job; return its pointer, or None if ckptd skipped it."""
        if not self._job_settled:
            self.job = self._job_for_new_run()
            self._job_settled = True
        last = self._last[0].step if self._last is not None else -1
        step = max(global_step, last + 1)  # the same global step saved again with other tensors: a step of its own
        c = self._opened()
        handle = c.save_async(checkpoint, step=step)
        if handle.skipped:  # staging policy "skip" found no room (ckpt logged why)
            log.warning(
                "ckpt: global step %d was not saved, so %s is not written: %s", global_step, path, handle.reason
            )
            return None
        self._in_flight.append(handle)
        pointer = Pointer(c.job, step, global_step, resolve_address(self.address))
        self._last = (pointer, tensors)
        return pointer

    def _job_for_new_run(self) -> str:
        """Return the job a run that loaded none of its job's checkpoints saves to: the first version not used yet.

        The plugin's job if it holds no step, else JOB-v1, JOB-v2, ... (as Lightning names a new
        run's files in a used directory): a new run never mixes its steps into another run's line.
        """
        base = self._base_job
        assert base is not None
        job, used = new_run_job(base, self.address)
        if used is None:
            return job
        log.warning(
            "ckpt: job %s holds steps up to %d of another run, and this run loaded none of them: it saves to "
            "job %s, as Lightning versions its files (to continue a run, resume it from its checkpoint: "
            "Trainer.fit(ckpt_path=...))",
            base,
            used,
            job,
        )
        return job

    def _opened(self) -> Checkpointer:
        """Return the plugin's Checkpointer, opened by the first save or load after each teardown.

        Saves and loads share it: a resumed run's saves continue the line of the step it loaded.
        It is closed by teardown, or when the plugin goes or the interpreter exits, for Lightning
        does not call teardown of a plugin wrapped in its AsyncCheckpointIO.
        """
        if self._checkpointer is None:
            assert self.job is not None
            self._checkpointer = Checkpointer(job=self.job, rank=0, world_size=1, address=self.address)
            self._at_exit.append(weakref.finalize(self, self._checkpointer.close))
        return self._checkpointer

    def _file_writer(self) -> TorchFileWriter:
        """Return the writer of torch files, started by the first save after each teardown."""
        if self._torch_files is None:
            assert self.job is not None
            self._torch_files = TorchFileWriter(self.job, self.address)
            # At exit finalizers run newest first: the files are finished before the Checkpointer closes.
            self._at_exit.append(weakref.finalize(self, _close_quietly, self._torch_files))
        return self._torch_files

    def _raise_failures(self) -> None:
        """Forget the saves that reached teardown_tier; raise SaveFailed for one that failed."""
        for handle in list(self._in_flight):
            try:
                done = handle.done(self.teardown_tier)
            except SaveFailed:
                self._in_flight.remove(handle)
                raise
            if done:
                self._in_flight.remove(handle)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Return the checkpoint the pointer at path names (tensors on map_location, default CPU), bit for bit.

        The pointer may be in a pointer file or in the torch file that replaced it. A torch file is read
        itself when weights_only is true, or when ckptd no longer holds its step; any other file at path
        is read as TorchCheckpointIO reads it. A step read from ckptd is loaded with weights_only as
        Checkpointer.load takes it (None: False, as Lightning's own default means).
        """
        pointer, torch_file = _read_path(str(path))
        if pointer is None or (torch_file and weights_only):
            return self._load_file(path, map_location, weights_only)
        if self._base_job is None:
            self._base_job = pointer.job  # a plugin given no job resumes the pointer's, and its saves continue it
        if pointer.job != self.job and self._is_version(pointer.job):
            self.teardown()  # the saves made to another version so far are finished as they were
            self.job = pointer.job  # a run resumed from a version of the plugin's job continues that version
        if pointer.job == self.job:
            self._job_settled = True
        # The plugin's own job is loaded through its Checkpointer: the saves after it continue from that step.
        own = pointer.job == self.job
        c = self._opened() if own else Checkpointer(job=pointer.job, rank=0, world_size=1, address=self.address)
        with contextlib.nullcontext(c) if own else c:
            try:
                checkpoint = self._load_step(c, pointer, str(path), map_location, bool(weights_only))
            except NotFound:
                if not torch_file:
                    raise
                log.warning("ckpt: ckptd holds step %d of %s no more: reading %s", pointer.step, pointer.job, path)
                checkpoint = self._load_file(path, map_location, weights_only)
        if own:
            self._last = None  # the saves after a load follow its step, not the plugin's earlier saves
        return checkpoint

    def _load_file(self, path: _PATH, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """Read the file at path as TorchCheckpointIO reads it, less the pointer a torch file of ours carries."""
        checkpoint: dict[str, Any] = self._files.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )
        checkpoint.pop(POINTER_KEY, None)
        return checkpoint

    @staticmethod
    def _load_step(
        c: Checkpointer, pointer: Pointer, path: str, map_location: Any, weights_only: bool
    ) -> dict[str, Any]:
        """Load the pointer's step through c, waiting for a fresh copy's flush if need be."""
        try:
            checkpoint: dict[str, Any] = c.load(pointer.step, map_location or "cpu", weights_only=weights_only)
        except NotFound as e:
            # A step is served from memory once the daemon has checksummed it, a moment after the
            # save returned: if ckptd still holds the copy, wait for its flush (SaveFailed if it failed).
            copy = SaveHandle(c, pointer.step, skipped=False, blocked_s=0.0, reason="")
            if not copy.done("memory"):
                raise NotFound(
                    f"{path} names step {pointer.step} (global step {pointer.global_step}) of ckptd job "
                    f"{pointer.job}, saved through {pointer.address}, and no tier holds it any more: {e}"
                ) from e
            copy.wait("nvme", timeout=FLUSH_WAIT_S)
            checkpoint = c.load(pointer.step, map_location or "cpu", weights_only=weights_only)
        return checkpoint

    def _is_version(self, job: str) -> bool:
        """Say whether job is the plugin's job or one of its versions (JOB-v1, JOB-v2, ...)."""
        assert self._base_job is not None
        return re.fullmatch(rf"{re.escape(self._base_job)}(-v[1-9][0-9]*)?", job) is not None

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the pointer (or file) at path; the step it names stays in ckptd until its retention drops it."""
        files = self._torch_files  # read once: under AsyncCheckpointIO a save on its thread may tear down
        if files is not None:
            files.forget(str(path))
        self._files.remove_checkpoint(path)

    def teardown(self) -> None:
        """Wait until every save has reached teardown_tier ("nvme": and its torch files), close, raise a failure."""
        in_flight, self._in_flight = self._in_flight, []
        for closer in self._at_exit:
            closer.detach()  # closed here instead
        self._at_exit = []
        failure: CheckpointError | None = None
        for handle in in_flight:
            try:
                handle.wait(self.teardown_tier)
            except CheckpointError as e:
                failure = failure or e
        if self._torch_files is not None:
            try:
                self._torch_files.close(wait=self.teardown_tier == "nvme")
            except CheckpointError as e:
                failure = failure or e
            self._torch_files = None
        if self._checkpointer is not None:
            self._checkpointer.close()  # a later save opens another: the plugin stays picklable between runs
            self._checkpointer = None
        if failure is not None:
            raise failure


def _close_quietly(files: TorchFileWriter) -> None:
    """Finish a plugin's torch files when nobody called its teardown (it went, or the interpreter exits)."""
    try:
        files.close(wait=True)
    except CheckpointError as e:
        log.warning("ckpt: %s", e)


def fingerprint(checkpoint: dict[str, Any]) -> Fingerprint | None:
    """Identify a checkpoint's tensors by memory and version counter, or None if one keeps no version counter.

    The tensors are those save_async would stage, wherever they sit (ckpt.flatten). Two
    fingerprints are equal only if the second dict holds the same tensors (views of the same
    memory, as state_dict() returns afresh each time) and none was changed in place in
    between: an optimizer step, a load_state_dict or an averaging callback bumps the counter.
    """
    identities = []
    for array in flatten(checkpoint).arrays:
        if not isinstance(array, torch.Tensor):
            return None  # a numpy array keeps no version counter
        try:
            identities.append(
                (array.data_ptr(), array._version, array.dtype, array.shape, array.stride(), array.device)
            )
        except RuntimeError:  # an inference-mode tensor keeps none either
            return None
    return tuple(identities)


def _overlaps_no_training() -> bool:
    """Say whether the calling thread saves where no training waits on it: Trainer.save_checkpoint outside fit, or
    AsyncCheckpointIO's thread (read from the calling thread's frames: Lightning tells a CheckpointIO neither)."""
    try:
        from lightning.pytorch import Trainer
        from lightning.pytorch.loops.fit_loop import _FitLoop
        from lightning.pytorch.plugins.io import async_plugin
    except ImportError:  # Fabric alone: no Trainer
        return False
    trainer_save, fit_loop, wrapper = Trainer.save_checkpoint.__code__, _FitLoop.run.__code__, async_plugin.__file__
    by_trainer = False
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is fit_loop:
            return False
        if code.co_filename == wrapper:
            return True
        by_trainer = by_trainer or code is trainer_save
        frame = frame.f_back
    return by_trainer


def _refuse_other_ranks() -> None:
    """Refuse a save on a rank other than 0: the whole state is rank 0's, saved as the only rank of its step."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        raise InvalidArgument(
            f"CkptdCheckpointIO.save_checkpoint was called on rank {dist.get_rank()}: it saves whole checkpoints "
            "from global rank 0, as Lightning calls it (one device, DDP); to save each rank's shard, use "
            "ckpt.Checkpointer or ckpt.dcp with the group's world size"
        )
