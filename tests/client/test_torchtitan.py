"""CkptdCheckpointManager as torchtitan's config makes it, its refusal without a job, its step names: no daemon."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from ckpt_core.errors import InvalidArgument

pytest.importorskip("torchtitan", reason="torchtitan is not installed")

import tyro
from ckpt.torchtitan import CkptdCheckpointManager, titan_step
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.config.manager import custom_registry


@dataclass(kw_only=True)
class TrainerConfig:
    """The part of torchtitan's Trainer.Config that holds the checkpointer, typed as Trainer types it."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def test_torchtitans_command_line_keeps_the_manager_a_config_registry_function_chose_and_takes_its_job():
    chosen = TrainerConfig(checkpoint=CkptdCheckpointManager.Config(enable=True, job="llama3", keep_latest_k=3))
    args = ["--checkpoint.job", "llama3-b", "--checkpoint.interval", "7"]
    parsed = tyro.cli(TrainerConfig, args=args, default=chosen, registry=custom_registry)  # as ConfigManager parses
    assert isinstance(parsed.checkpoint, CkptdCheckpointManager.Config)
    assert (parsed.checkpoint.job, parsed.checkpoint.interval, parsed.checkpoint.keep_latest_k) == ("llama3-b", 7, 3)
    assert parsed.checkpoint._owner is CkptdCheckpointManager  # what Trainer's config.checkpoint.build() makes


def test_a_manager_without_a_job_says_where_to_set_one(monkeypatch, tmp_path):
    monkeypatch.delenv("CKPT_JOB", raising=False)
    model = torch.nn.Linear(2, 2)
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")], implementation="for-loop"
        ),
        model_parts=[model],
    )
    config = CkptdCheckpointManager.Config(enable=True)
    with pytest.raises(InvalidArgument, match=r"set checkpoint.job \(--checkpoint.job J\) or env CKPT_JOB"):
        config.build(
            dataloader=None,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=4),
            states={},
            sd_adapter=None,
            base_folder=str(tmp_path),
        )


def test_torchtitans_step_directory_names_the_step_and_anything_else_is_refused():
    assert titan_step("/out/checkpoint/step-40") == 40
    assert titan_step("s3://bucket/run/checkpoint/step-0/") == 0
    with pytest.raises(InvalidArgument, match="does not end in step-N"):
        titan_step("/out/checkpoint/last")
