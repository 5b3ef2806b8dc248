"""CkptdTrainer's refusals when it is made, and its pointer files: no daemon needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ckpt.huggingface import POINTER_NAME, CkptdTrainer, Pointer, read_pointer
from ckpt_core.errors import InvalidArgument
from transformers import TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from huggingface_train import Tokens, tiny_gpt2


def test_a_trainer_without_a_job_asks_for_one(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPT_JOB", raising=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(InvalidArgument, match=r"needs a ckptd job: pass job=\.\.\. or set CKPT_JOB"):
        CkptdTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())


def test_load_best_model_at_end_is_refused_by_name(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
    )
    with pytest.raises(InvalidArgument, match="does not support load_best_model_at_end"):
        CkptdTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(), job="j")


def test_a_pointer_reads_back_and_a_broken_one_names_its_path(tmp_path):
    Pointer("j", 8, "unix:/x").write(str(tmp_path / "checkpoint-8"))
    assert read_pointer(str(tmp_path / "checkpoint-8")) == Pointer("j", 8, "unix:/x")
    assert read_pointer(str(tmp_path)) is None  # a directory Trainer wrote itself
    (tmp_path / POINTER_NAME).write_text('{"format": "ckptd-huggingface-pointer", "version": 1, "job": "j"}')
    with pytest.raises(InvalidArgument, match=f"{tmp_path / POINTER_NAME} is a broken ckptd pointer"):
        read_pointer(str(tmp_path))
