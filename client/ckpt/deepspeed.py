"""DeepSpeed's checkpoint engine on ckptd: CkptdCheckpointEngine, the interface Nebula plugged into.

DeepSpeed's engine.save_checkpoint(save_dir, tag) calls, on every rank, create(info), then save(state_dict, path)
for each file this rank writes (save_dir/tag/mp_rank_00_model_states.pt on the data-parallel writer,
zero_pp_rank_R_mp_rank_00_optim_states.pt per rank under ZeRO), then commit(info), then writes save_dir/latest
(rank 0) itself. CkptdCheckpointEngine keeps the state dicts save() is given, and commit() hands them to
Checkpointer.save_async as one step of the job, this rank's shard {"tag": tag, "files": {file name: state dict}}:
training is blocked only for ckptd's one copy into shared memory (DeepSpeed's own clone for torch.save is
skipped, preserves_storage_sharing() is False). Then commit() writes a small JSON pointer at each path
(Pointer: job, step, the saving rank), so that DeepSpeed's loading, which lists and opens files by name,
finds them; the `latest` file stays DeepSpeed's, written after the commit. A kill -9 before commit leaves no
step and no pointer; after it, the step is in ckptd's memory tier and on its way to NVMe.

load(path) reads the pointer and returns that file's state dict from the step (the fastest tier holding a good
copy); another rank's file (ZeRO's model states, elastic optimizer states) is read through a Checkpointer of
that rank. A path that is not a pointer (a checkpoint written by DeepSpeed's TorchCheckpointEngine) is read
with torch.load, as DeepSpeed would.

The step of a tag is the number it ends in: DeepSpeed's default tag global_stepN is step N; a tag with no
number at its end is refused (ckptd steps are numbers). A run that loads none of its job's checkpoints before
its first save saves to the first of JOB, JOB-v1, ... holding no step (ckpt.job_versions, chosen by rank 0 and
broadcast), and a load continues the loaded job, as ckpt.lightning and ckpt.huggingface do.

Who calls what, on which thread: DeepSpeed calls create, save, commit and load on each rank's training thread,
every rank alike in save_checkpoint and load_checkpoint. Enable it once the engine exists:
engine.checkpoint_engine = CkptdCheckpointEngine(job=...). Importing this module imports deepspeed;
`import ckpt` does not.
"""

from __future__ import annotations

from ckpt.torch_version import require_torch

require_torch()

import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from ckpt_core.errors import InvalidArgument  # noqa: E402
from ckpt_core.format import validate_job, validate_rank, validate_step  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (  # noqa: E402
    CheckpointCommitInfo,
    CheckpointEngine,
)

from ckpt.checkpointer import Checkpointer, SaveHandle  # noqa: E402
from ckpt.job_versions import new_run_job  # noqa: E402
from ckpt.pointer_file import broken_pointer, pointer_bytes, pointer_fields, write_local_pointer  # noqa: E402

log = logging.getLogger(__name__)

POINTER_FORMAT = "ckptd-deepspeed-pointer"
POINTER_VERSION = 1
_TAG_STEP = re.compile(r".*?(\d+)")


@dataclass(frozen=True)
class Pointer:
    """What a DeepSpeed file written by CkptdCheckpointEngine says: the job, step and rank whose shard holds it."""

    job: str
    step: int
    rank: int
    world_size: int
    file: str  # the file's name in the tag's directory, its key in the shard's "files"

    def write(self, path: str) -> None:
        """Write the pointer at path, atomically."""
        write_local_pointer(path, pointer_bytes(POINTER_FORMAT, POINTER_VERSION, asdict(self)))


def read_pointer(path: str) -> Pointer | None:
    """Return the pointer written at path; None for a file that is not one (a torch file)."""
    with open(path, "rb") as f:
        head = f.read(1)
        if head != b"{":
            return None
        text = head + f.read()
    fields = pointer_fields(text, path, POINTER_FORMAT, POINTER_VERSION)
    with broken_pointer(path):
        job, step, file = validate_job(fields["job"]), validate_step(fields["step"]), str(fields["file"])
        return Pointer(job, step, *validate_rank(fields["rank"], fields["world_size"]), file)


def step_of_tag(tag: str) -> int:
    """Return the ckptd step of a DeepSpeed tag: the number it ends in (global_step100 -> 100)."""
    found = _TAG_STEP.fullmatch(tag)
    if found is None:
        raise InvalidArgument(
            f"DeepSpeed tag {tag!r} ends in no number, and ckptd steps are numbers: save with tag=None "
            "(DeepSpeed's global_stepN) or a tag that ends in the step number"
        )
    return validate_step(int(found[1]))


class CkptdCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine on ckptd (see the module docstring for the order of DeepSpeed's calls).

    job: else env CKPT_JOB; options go to Checkpointer (keep, keep_every, copy_threads, ...).
    """

    def __init__(self, job: str | None = None, address: str | None = None, **options: Any) -> None:
        super().__init__(None)
        self.name = "CkptdCheckpointEngine"
        base = job or os.environ.get("CKPT_JOB")
        if not base:
            raise InvalidArgument("CkptdCheckpointEngine needs a ckptd job: pass job=... or set CKPT_JOB")
        self._base_job = validate_job(base)
        self.address = address
        self._options = options
        self._job: str | None = None  # decided at the first load or save
        self._checkpointer: Checkpointer | None = None  # this rank's, in self._job
        self._readers: dict[int, Checkpointer] = {}  # other ranks' shards, read for their files
        self._loaded: dict[int, tuple[int, dict[str, Any]]] = {}  # rank -> (step, its files not handed out)
        self._line_step: int | None = None  # the step this rank's Checkpointer last loaded
        self._pending: dict[str, Any] = {}  # the files save() was given since create()
        self._info: CheckpointCommitInfo | None = None
        self.last_handle: SaveHandle | None = None  # the last commit's save, for wait(tier)

    def create(self, info: CheckpointCommitInfo) -> None:
        """Begin the tag's checkpoint: its step is checked here, before DeepSpeed hands over any state."""
        step_of_tag(info.tag)
        self._info = info
        self._pending, self._loaded = {}, {}  # what a resume left unread is let go here

    def save(self, state_dict: Any, path: str) -> None:
        """Keep one of the tag's files until commit; nothing is copied yet (training waits for commit anyway)."""
        info = self._require_created("save")
        tag_dir = os.path.join(info.save_dir, info.tag)
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(tag_dir):
            raise InvalidArgument(
                f"CkptdCheckpointEngine saves the files of a tag's directory ({tag_dir}), not {path}: "
                "use DeepSpeed's TorchCheckpointEngine for files written elsewhere"
            )
        self._pending[os.path.basename(path)] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Save the tag's files as one step (returns after the copy), then write their pointers; True if saved.

        A save skipped (the daemon's policy "skip", or the step already complete) writes no pointer and
        says so in a warning.
        """
        created = self._require_created("commit")
        if info.tag != created.tag or info.save_dir != created.save_dir:
            raise InvalidArgument(f"commit of tag {info.tag!r} after create of tag {created.tag!r}")
        checkpointer = self._open(self._job or self._new_run_job())
        step = step_of_tag(info.tag)
        handle = checkpointer.save_async({"tag": info.tag, "files": self._pending}, step=step)
        self.last_handle = handle
        files, self._pending, self._info = self._pending, {}, None
        if handle.skipped:
            # DeepSpeed writes `latest` after this whatever commit says; without pointers its load then fails
            # on this tag by name, never on another step's bytes.
            log.warning(
                "ckpt: DeepSpeed tag %s (%s step %d) was not saved on rank %d: %s; no pointers written",
                info.tag,
                checkpointer.job,
                step,
                checkpointer.rank,
                handle.reason,
            )
            return False
        tag_dir = os.path.join(info.save_dir, info.tag)
        for file in files:
            Pointer(checkpointer.job, step, checkpointer.rank, checkpointer.world_size, file).write(
                os.path.join(tag_dir, file)
            )
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """Return the state dict saved at path: from ckptd for a pointer, with torch.load for a torch file.

        A rank's shard of a step is read with the map_location of the load that reads it (DeepSpeed asks
        for CPU throughout); its other files are held for their loads and let go as each is handed out.
        A file asked for again (DeepSpeed reads the model states twice) reads the shard again.
        """
        pointer = read_pointer(path)
        if pointer is None:
            return torch.load(path, map_location=map_location, weights_only=False)
        own = self._open(pointer.job)
        if own.world_size != pointer.world_size:
            raise InvalidArgument(
                f"{path} was saved by {pointer.world_size} ranks and this run has {own.world_size}: "
                "CkptdCheckpointEngine resumes at the world size it saved with"
            )
        if pointer.rank == own.rank:
            return self._take(own, pointer, path, map_location)
        if self._line_step != pointer.step:
            # This rank's own shard is read once, so that its saves continue the line of the step loaded.
            self._read(own, pointer.step, map_location)
        reader = self._readers.get(pointer.rank)
        if reader is None:
            reader = Checkpointer(pointer.job, pointer.rank, pointer.world_size, self.address)
            self._readers[pointer.rank] = reader
        return self._take(reader, pointer, path, map_location)

    def preserves_storage_sharing(self) -> bool:
        """Say False: ckptd copies each tensor's own bytes, so DeepSpeed need not clone views before save()."""
        return False

    def cleanup(self) -> None:
        """Close the Checkpointers (DeepSpeed calls this for decoupled engines only; close() is the same)."""
        self.close()

    def close(self) -> None:
        """Close this rank's Checkpointer and the readers; saves already made go on in the daemon."""
        for c in [self._checkpointer, *self._readers.values()]:
            if c is not None:
                c.close()
        self._checkpointer, self._readers, self._loaded, self._line_step = None, {}, {}, None

    def __enter__(self) -> CkptdCheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_created(self, call: str) -> CheckpointCommitInfo:
        if self._info is None:
            raise InvalidArgument(f"CkptdCheckpointEngine.{call} without create(): DeepSpeed calls create first")
        return self._info

    def _open(self, job: str) -> Checkpointer:
        """Return this rank's Checkpointer in job; a load of another job's pointer moves the later saves there."""
        if self._checkpointer is not None and self._checkpointer.job == job:
            return self._checkpointer
        self.close()
        self._job = job
        self._checkpointer = Checkpointer(job=job, address=self.address, **self._options)
        return self._checkpointer

    def _take(self, checkpointer: Checkpointer, pointer: Pointer, path: str, map_location: Any) -> Any:
        """Hand out one file of a shard, reading the shard unless it is held with the file still in it."""
        held = self._loaded.get(pointer.rank)
        if held is None or held[0] != pointer.step or pointer.file not in held[1]:
            held = self._read(checkpointer, pointer.step, map_location)
        if pointer.file not in held[1]:
            shard = f"{pointer.job} step {pointer.step} rank {pointer.rank}"
            raise InvalidArgument(f"{path}: {shard} holds no {pointer.file} (a pointer written by hand?)")
        value = held[1].pop(pointer.file)
        if not held[1]:
            del self._loaded[pointer.rank]
        return value

    def _read(self, checkpointer: Checkpointer, step: int, map_location: Any) -> tuple[int, dict[str, Any]]:
        """Read checkpointer's rank's shard of step and hold its files (this rank's: its saves continue after)."""
        state = checkpointer.load(step, map_location=map_location)
        held = (step, dict(state["files"]))
        self._loaded[checkpointer.rank] = held
        if checkpointer is self._checkpointer:
            self._line_step = step
        return held

    def _new_run_job(self) -> str:
        """Return the job of a run that loaded nothing: rank 0 picks it, every rank takes it (ckpt.job_versions)."""
        job, used = new_run_job(self._base_job, self.address, every_rank=True)
        if used is not None:
            log.warning(
                "ckpt: job %s holds steps (newest %d) of a run this one did not load: saving to %s",
                self._base_job,
                used,
                job,
            )
        return job
