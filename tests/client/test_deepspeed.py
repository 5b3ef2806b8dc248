"""CkptdCheckpointEngine's mapping of tags to steps, its refusals and its pointer files: no daemon needed."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

import torch
from ckpt.deepspeed import POINTER_FORMAT, CkptdCheckpointEngine, Pointer, read_pointer, step_of_tag
from ckpt_core.errors import InvalidArgument
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo


@pytest.mark.parametrize(("tag", "step"), [("global_step100", 100), ("7", 7), ("epoch2-step40", 40)])
def test_a_tag_is_the_step_it_ends_in(tag, step):
    assert step_of_tag(tag) == step


def test_a_tag_beyond_the_step_bound_is_refused_by_the_bound():
    with pytest.raises(InvalidArgument, match="step"):
        step_of_tag(f"global_step{2**63}")


def test_an_engine_without_a_job_asks_for_one(monkeypatch):
    monkeypatch.delenv("CKPT_JOB", raising=False)
    with pytest.raises(InvalidArgument, match=r"needs a ckptd job: pass job=\.\.\. or set CKPT_JOB"):
        CkptdCheckpointEngine()


def test_a_file_outside_the_tags_directory_and_a_save_before_create_are_refused(tmp_path):
    engine = CkptdCheckpointEngine(job="j")
    with pytest.raises(InvalidArgument, match="without create"):
        engine.save({}, str(tmp_path / "global_step1" / "a.pt"))
    engine.create(CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=True))
    with pytest.raises(InvalidArgument, match=r"saves the files of a tag's directory .*TorchCheckpointEngine"):
        engine.save({}, str(tmp_path / "elsewhere.pt"))


def test_a_pointer_reads_back_and_a_torch_file_is_not_one(tmp_path):
    pointer = Pointer("j", 8, 1, 2, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    pointer.write(str(tmp_path / "p.pt"))
    assert read_pointer(str(tmp_path / "p.pt")) == pointer
    assert not list(tmp_path.glob("*.partial"))
    torch.save({"a": 1}, tmp_path / "t.pt")
    assert read_pointer(str(tmp_path / "t.pt")) is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "is not a ckptd pointer"),
        ('{"format": "other"}', f'no "format": "{POINTER_FORMAT}"'),
        (f'{{"format": "{POINTER_FORMAT}", "version": 9}}', "of version 9; this ckpt reads version 1"),
        (f'{{"format": "{POINTER_FORMAT}", "version": 1, "job": "j"}}', "broken ckptd pointer: KeyError"),
    ],
)
def test_a_file_that_is_no_good_pointer_says_which(tmp_path, text, says):
    (tmp_path / "p.pt").write_text(text)
    with pytest.raises(InvalidArgument, match=says.replace("(", r"\(")):
        read_pointer(str(tmp_path / "p.pt"))
