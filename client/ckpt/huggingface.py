"""Hugging Face Trainer and Accelerate: CkptdTrainer(job=...) for Trainer, AcceleratorCheckpoints for Accelerate.

CkptdTrainer is a transformers.Trainer whose checkpoints go to ckptd. Where Trainer writes
output_dir/checkpoint-N with model, optimizer, scheduler, scaler and RNG files (seconds of
torch.save and safetensors writes on the training thread), CkptdTrainer hands the same states to
Checkpointer.save_async at step N (the global step) and goes on training as soon as they are
copied into ckptd's shared memory. checkpoint-N stays a directory, so that everything that looks
for checkpoints by name finds it (get_last_checkpoint, resume_from_checkpoint=True, rotation by
save_total_limit), but it is a pointer: it holds HF's own trainer_state.json and ckptd.json, the
job and step that hold the bytes (Pointer). Writing the weights again as files would be the
synchronous write the adapter exists to avoid; `ckptd restore` or ckpt.load gives the states
back, and trainer.save_model() still writes a real model directory for from_pretrained.

resume_from_checkpoint=True (or the path of a checkpoint-N) loads the step the pointer names once,
from the fastest tier holding a good copy, and hands each part to the Trainer where it would have
read the file (model before prepare, optimizer and scheduler after, RNG once the data is skipped);
a checkpoint-N without ckptd.json is read by Trainer itself. A resumed run saves on in the job of
the checkpoint it loaded, starting a new line of the job's history from it (docs/DESIGN.md, "A
job's history"). A run that does not resume in a used job saves to JOB-v1, JOB-v2, ...
(ckpt.job_versions), and a warning names it. save_total_limit is the job's retention (keep=): ckptd
keeps that many newest steps, as Trainer keeps that many checkpoint-N directories.

Who calls what, on which thread: Trainer calls _save_checkpoint on the training thread of every
process at each save_steps (each process saves its own shard, rank = process_index, with its own
RNG), and the _load_* methods on the training thread while train() resumes. train() closes the
Checkpointer when it returns or raises. Not supported, and refused when the Trainer is made:
DeepSpeed and FSDP (they write their own checkpoint files), load_best_model_at_end (ckptd's
retention keeps the newest steps, not the best), push_to_hub of checkpoints.

AcceleratorCheckpoints(accelerator, job=...) is Accelerate's save_state/load_state on ckptd: it
saves what Accelerator.save_state would (every prepared model, optimizer and scheduler, the
objects given to register_for_checkpointing, the scaler, accelerator.step and the RNG states) as
one step per process, and load_state puts them back. The training loop calls both on its own
thread; save_state returns once the states are copied.

Importing this module imports transformers and accelerate; `import ckpt` does not.
"""

from __future__ import annotations

from ckpt.torch_version import require_torch

require_torch()

import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from ckpt_core.daemon_socket import resolve_address  # noqa: E402
from ckpt_core.errors import InvalidArgument  # noqa: E402
from ckpt_core.format import validate_job, validate_step  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints  # noqa: E402

from ckpt.checkpointer import Checkpointer, SaveHandle  # noqa: E402
from ckpt.job_versions import new_run_job  # noqa: E402
from ckpt.pointer_file import broken_pointer, pointer_bytes, pointer_fields, write_local_pointer  # noqa: E402

log = logging.getLogger(__name__)

POINTER_NAME = "ckptd.json"
POINTER_FORMAT = "ckptd-huggingface-pointer"
POINTER_VERSION = 1


@dataclass(frozen=True)
class Pointer:
    """What a checkpoint-N directory's ckptd.json says: which ckptd job and step hold that checkpoint."""

    job: str
    step: int
    address: str  # the daemon the step was saved through, for people and errors: loads use the Trainer's

    def write(self, checkpoint_dir: str) -> None:
        """Write the pointer into checkpoint_dir (made if need be), atomically."""
        os.makedirs(checkpoint_dir, exist_ok=True)
        path = os.path.join(checkpoint_dir, POINTER_NAME)
        write_local_pointer(path, pointer_bytes(POINTER_FORMAT, POINTER_VERSION, asdict(self)))


def read_pointer(checkpoint_dir: str) -> Pointer | None:
    """Return the pointer of a checkpoint-N directory; None for a directory Trainer wrote itself."""
    path = os.path.join(checkpoint_dir, POINTER_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    fields = pointer_fields(data, path, POINTER_FORMAT, POINTER_VERSION)
    with broken_pointer(path):
        return Pointer(validate_job(fields["job"]), validate_step(fields["step"]), str(fields["address"]))


def rng_states() -> dict[str, Any]:
    """Return this process's RNG states (Python, NumPy, torch's CPU and CUDA generators), as Trainer saves them."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back the RNG states rng_states returned."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class CkptdTrainer(Trainer):
    """A transformers.Trainer that checkpoints into ckptd without blocking training (see the module docstring)."""

    def __init__(self, *args: Any, job: str | None = None, address: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        base = job or os.environ.get("CKPT_JOB")
        if not base:
            raise InvalidArgument("CkptdTrainer needs a ckptd job: pass job=... or set CKPT_JOB")
        self._base_job = validate_job(base)
        self.address = address
        refused = {
            "DeepSpeed": self.is_deepspeed_enabled,
            "FSDP": self.is_fsdp_enabled,
            "load_best_model_at_end": self.args.load_best_model_at_end,
            "push_to_hub": self.args.push_to_hub,
        }
        if any(refused.values()):
            names = ", ".join(name for name, on in refused.items() if on)
            raise InvalidArgument(f"CkptdTrainer does not support {names}; use transformers.Trainer for that run")
        limit = self.args.save_total_limit
        self._keep = limit if limit is not None and limit > 0 else None
        self._checkpointer: Checkpointer | None = None
        self._resumed: dict[str, Any] | None = None  # the parts of the loaded step not handed to the Trainer yet

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Run Trainer.train, then close the Checkpointer (a later train() opens another)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._resumed = None
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None

    def _open(self, job: str) -> Checkpointer:
        """Open the Checkpointer this train() saves (and resumes) through, in job."""
        self._checkpointer = Checkpointer(
            job=job,
            rank=self.args.process_index,
            world_size=self.args.world_size,
            address=self.address,
            keep=self._keep,
        )
        return self._checkpointer

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Save the checkpoint of this global step into ckptd, write its pointer directory, rotate the old ones."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        c = self._checkpointer
        if c is None:  # a run that loaded none of its job's steps
            job, used = new_run_job(self._base_job, self.address, every_rank=True)
            if used is not None:
                log.warning(
                    "ckpt: job %s holds steps up to %d of another run, and this run resumed from none of them: it "
                    "saves to job %s (to continue a run, train(resume_from_checkpoint=True))",
                    self._base_job,
                    used,
                    job,
                )
            c = self._open(job)
        state: dict[str, Any] = {"model": self.accelerator.get_state_dict(self.model)}
        if not self.args.save_only_model:
            scaler = getattr(self.accelerator, "scaler", None)
            optimizer, scheduler = self.optimizer, self.lr_scheduler
            assert optimizer is not None and scheduler is not None  # Trainer creates both before its first step
            state["optimizer"] = optimizer.state_dict()
            state["scheduler"] = scheduler.state_dict()
            state["scaler"] = scaler.state_dict() if scaler is not None else None
            state["rng"] = rng_states()
        handle = c.save_async(state, step=self.state.global_step)
        if self.args.should_save:
            Pointer(c.job, handle.step, resolve_address(self.address)).write(output_dir)
            self._record_callback_states()
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit, use_mtime=True)

    def _record_callback_states(self) -> None:
        """Put the states of the stateful callbacks and of TrainerControl into the trainer state, as Trainer does."""
        # TrainerState declares a list of callbacks, and turns it into {class name: state} when it is made.
        states: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(states[name], list):
                    states[name].append(cb_state)
                else:
                    states[name] = cb_state

    def _resumed_part(self, checkpoint: str, part: str) -> Any:
        """Return one part of the step checkpoint points to, loading the step at the first call of a resume."""
        if self._resumed is None:
            pointer = read_pointer(checkpoint)
            assert pointer is not None
            c = self._checkpointer
            if c is None or c.job != pointer.job:
                if c is not None:
                    c.close()
                c = self._open(pointer.job)
            self._resumed = c.load(pointer.step)
        return self._resumed.pop(part, None)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if read_pointer(resume_from_checkpoint) is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = model or self.model
        assert target is not None  # Trainer resumes a model it was given
        target.load_state_dict(self._resumed_part(resume_from_checkpoint, "model"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or read_pointer(checkpoint) is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        saved = self._resumed_part(checkpoint, "optimizer")
        if saved is not None:  # None: saved with save_only_model
            optimizer, scheduler = self.optimizer, self.lr_scheduler
            assert optimizer is not None and scheduler is not None  # Trainer creates both before it calls this
            optimizer.load_state_dict(saved)
            scheduler.load_state_dict(self._resumed_part(checkpoint, "scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or read_pointer(checkpoint) is None:
            return super()._load_scaler(checkpoint)
        scaler = self._resumed_part(checkpoint, "scaler")
        if scaler is not None and getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.scaler.load_state_dict(scaler)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or read_pointer(checkpoint) is None:
            return super()._load_rng_state(checkpoint)
        states = self._resumed_part(checkpoint, "rng")
        if states is not None:
            set_rng_states(states)


class AcceleratorCheckpoints:
    """Accelerator.save_state / load_state on ckptd: one step per save, one shard per process."""

    def __init__(
        self, accelerator: Accelerator, job: str | None = None, address: str | None = None, keep: int | None = None
    ) -> None:
        self.accelerator = accelerator
        self.checkpointer = Checkpointer(
            job=job,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            address=address,
            keep=keep,
        )

    def _state(self) -> dict[str, Any]:
        a = self.accelerator
        scaler = getattr(a, "scaler", None)
        return {
            "models": [a.get_state_dict(m, unwrap=True) for m in a._models],
            "optimizers": [o.state_dict() for o in a._optimizers],
            "schedulers": [s.state_dict() for s in a._schedulers],
            "custom": [o.state_dict() for o in a._custom_objects],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "step": a.step,
            "rng": rng_states(),
        }

    def save_state(self, step: int | None = None) -> SaveHandle:
        """Save what Accelerator.save_state would as step (None: one past the latest); return once copied."""
        return self.checkpointer.save_async(self._state(), step=step)

    def load_state(self, step: int | None = None) -> int | None:
        """Put back the states of step (None: the latest); return the step, or None when the job holds none."""
        if step is None:
            step = self.checkpointer.latest_step()
            if step is None:
                return None
        state = self.checkpointer.load(step)
        a = self.accelerator
        for target, saved, what in (
            (a._models, state["models"], "models"),
            (a._optimizers, state["optimizers"], "optimizers"),
            (a._schedulers, state["schedulers"], "schedulers"),
            (a._custom_objects, state["custom"], "objects registered for checkpointing"),
        ):
            if len(target) != len(saved):
                raise InvalidArgument(
                    f"step {step} of job {self.checkpointer.job} holds {len(saved)} {what}; this Accelerator has "
                    f"{len(target)}: prepare and register the same ones before load_state"
                )
        for model, sd in zip(a._models, state["models"], strict=True):
            a.unwrap_model(model).load_state_dict(sd)
        for optimizer, sd in zip(a._optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(sd)
        for scheduler, sd in zip(a._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(sd)
        for obj, sd in zip(a._custom_objects, state["custom"], strict=True):
            obj.load_state_dict(sd)
        scaler = getattr(a, "scaler", None)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
        a.step = state["step"]
        set_rng_states(state["rng"])
        return step

    def close(self) -> None:
        """Close the Checkpointer (saves already returned stay in ckptd)."""
        self.checkpointer.close()

    def __enter__(self) -> AcceleratorCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
