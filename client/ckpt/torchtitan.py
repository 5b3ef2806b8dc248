"""torchtitan's checkpoint manager on ckptd: CkptdCheckpointManager, a CheckpointManager whose DCP calls use ckpt.dcp.

torchtitan builds its checkpointer from its config (`config.checkpoint.build(...)`), so the
hook is the config: a training config that says

    checkpoint=CkptdCheckpointManager.Config(enable=True, job="llama3-8b", interval=500, async_mode="async")

gets torchtitan's own CheckpointManager (its save schedule, its states, its async modes, its
last-step and Hugging Face exports) with the step saves and loads going through the local daemon:
dcp.save / dcp.async_save with a ckpt.dcp.Writer, dcp.load with a ckpt.dcp.Reader. torchtitan's
`checkpoint.folder/step-N` is ckptd's step N of the job; nothing is written under the folder
(except a Hugging Face export, last_save_in_hf, which stays torchtitan's file). keep_latest_k is
the job's retention (keep=): the daemon keeps that many newest steps on NVMe and the replica store;
0 leaves it to the daemon's [retention] (as ckpt.huggingface does with save_total_limit=None).

async_mode: "disabled" returns once the step is durable on NVMe; "async" returns after one copy
into ckptd's shared memory (the Writer is its own stager), the future once the step is on NVMe;
"async_with_pinned_mem" runs DCP's process executor, whose process makes that copy (the training
thread waits for it, as for torchtitan's pinned staging) and whose staging future is then done.

A load (torchtitan's fault-tolerance branch) takes the job's latest complete step, or load_step;
a job with no step yet falls back to torchtitan's own: a step-N already in the folder (a run that
moves onto ckptd resumes from it), initial_load_path, the Hugging Face assets, or a fresh start.
Importing this module imports torchtitan and torch.distributed.checkpoint; `import ckpt` does not.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from ckpt_core.errors import InvalidArgument
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from ckpt.checkpointer import Checkpointer
from ckpt.dcp_reader import Reader
from ckpt.dcp_writer import Writer, process_rank

# torchtitan's name of a step's checkpoint (CheckpointManager._create_checkpoint_id): folder/step-N.
STEP_DIRECTORY = re.compile(r"step-(\d+)")


def titan_step(checkpoint_id: str) -> int:
    """Return the step N of torchtitan's checkpoint id `folder/step-N`."""
    match = STEP_DIRECTORY.fullmatch(os.path.basename(os.path.normpath(checkpoint_id)))
    if match is None:
        raise InvalidArgument(f"torchtitan checkpoint id {checkpoint_id!r} does not end in step-N")
    return int(match.group(1))


class CkptdCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager saving and loading its steps through ckptd.

    torchtitan's Trainer calls, on the training thread of every rank: load(step) once before
    training (-> _load), save(step) after each step (-> _save, which calls dcp_save when the
    interval or the last step says so, after waiting for the previous async save),
    maybe_wait_for_staging() before the next optimizer step, and close() at the end. The one
    Writer is used for one save at a time (torchtitan waits for the previous one first).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint config, and the ckptd job its steps go to."""

        job: str = ""
        """ckptd job of the run's steps; empty: env CKPT_JOB (with neither, InvalidArgument)."""

        address: str = ""
        """The local daemon's address; empty: env CKPTD_ADDRESS, else the daemon's default socket."""

    def __init__(self, config: Config, **components: Any) -> None:
        """Set torchtitan's manager up, then this rank's connections to the daemon (enabled configs only)."""
        super().__init__(config, **components)
        if not self.enable:
            return
        if not config.job and not os.environ.get("CKPT_JOB"):
            raise InvalidArgument(
                "CkptdCheckpointManager needs a ckptd job: set checkpoint.job (--checkpoint.job J) or env CKPT_JOB"
            )
        job = config.job or None
        address = config.address or None
        rank, world_size = process_rank(None, None)
        keep = self.keep_latest_k if self.keep_latest_k > 0 else None
        self.checkpointer = Checkpointer(job=job, rank=rank, world_size=world_size, address=address, keep=keep)
        self.writer = Writer(job=self.checkpointer.job, rank=rank, world_size=world_size, address=address, keep=keep)
        # The Writer is the pinned mode's stager: torchtitan then makes no DefaultStager of its own (a second copy,
        # into pinned buffers, which on a host without an accelerator it refuses to make), and close() closes it.
        self.stager = self.writer
        self.address = address
        logger.info(
            f"Checkpoints go to ckptd job {self.checkpointer.job!r} (step-N is its step N; keep "
            f"{keep if keep is not None else 'the daemon retention'}), not to {self.folder}"
        )

    def _close(self) -> None:
        """Stop torchtitan's threads and close its stager (the Writer), then the connection that finds steps."""
        super()._close()
        if hasattr(self, "checkpointer"):
            self.checkpointer.close()

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        """Save state_dict as step N of the job (checkpoint_id folder/step-N); a Hugging Face export stays a file."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = str(titan_step(checkpoint_id))
        result: Future[Any] | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            result = dcp.async_save(state_dict, storage_writer=self.writer, checkpoint_id=step, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            upload = dcp.async_save(
                state_dict,
                storage_writer=self.writer,
                checkpoint_id=step,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.writer,
            )
            assert isinstance(upload, Future)  # the Writer stages: async_save returned after its copy
            staged: Future[None] = Future()
            staged.set_result(None)
            result = AsyncSaveResponse(staging_completion=staged, upload_completion=upload)
        else:
            dcp.save(state_dict, storage_writer=self.writer, checkpoint_id=step)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _purge_stale_checkpoints(self) -> None:
        """Leave retention to the daemon: keep_latest_k is the job's keep=, sent with every save."""

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load the job's step (latest when -1) into torchtitan's states; with no step in ckptd, as torchtitan does."""
        if step == -1:
            latest = self.checkpointer.latest_step()
            if latest is None:
                return bool(super()._load(step))
            step = latest
        logger.info(f"Loading step {step} of ckptd job {self.checkpointer.job!r}.")
        states = self._states_to_load(model_only=step == 0)  # torchtitan's step 0: a seed checkpoint, model alone
        reader = Reader(job=self.checkpointer.job, address=self.address)
        try:
            dcp.load(states, storage_reader=reader, checkpoint_id=str(step))
        finally:
            reader.close()
        self.states[MODEL].load_state_dict(states)  # the model's keys are flattened into states, as dcp_load does
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True
