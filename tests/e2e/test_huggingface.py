"""CkptdTrainer and AcceleratorCheckpoints with a real daemon: kill -9 mid-run, resume, the same losses."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt.huggingface import read_pointer
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import huggingface_train
from huggingface_train import Tokens, make_trainer, tiny_gpt2
from transformers import Trainer, TrainerCallback

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
WORKER = HERE / "huggingface_worker.py"
ACCELERATE_EXAMPLE = HERE.parents[1] / "examples" / "accelerate_train.py"
WORKER_TIMEOUT_S = 120


def run(script: Path, *args: str, killed: bool = False) -> None:
    """Run a training process to its end (or to its SIGKILL, when killed)."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
    )
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout + done.stderr[-6000:]


def losses(out: Path) -> dict[int, float]:
    """Return every step's loss over the worker's processes, the later process's for a step run twice."""
    merged: dict[int, float] = {}
    for path in sorted(out.glob("losses-*.json"), key=lambda p: p.stat().st_mtime_ns):
        merged |= {int(k): v for k, v in json.loads(path.read_text()).items()}
    return merged


class StepCounter(TrainerCallback):
    """Count the steps a run trains."""

    def __init__(self) -> None:
        self.run = 0

    def on_step_end(self, *args: object, **kwargs: object) -> None:
        self.run += 1


def ls(daemon, job: str) -> list[int]:
    out = daemon.cli("ls", "--job", job, "--json", "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    return sorted(item["step"] for item in json.loads(out.stdout))


@pytest.mark.timeout(240)
def test_a_trainer_killed_mid_run_resumes_from_ckptd_with_the_losses_of_an_uninterrupted_run(daemon, short_tmp):
    common = ["--address", daemon.address, "--max-steps", "24"]
    whole, broken = short_tmp / "whole", short_tmp / "broken"
    run(WORKER, str(whole), "--job", "hf-whole", "--output-dir", str(short_tmp / "w"), *common)
    out_dir = short_tmp / "b"
    run(WORKER, str(broken), "--job", "hf", "--output-dir", str(out_dir), *common, "--die-at", "12", killed=True)
    assert get_last_checkpoint(str(out_dir)) == str(out_dir / "checkpoint-8")  # HF's own lookup finds the pointer
    run(WORKER, str(broken), "--job", "hf", "--output-dir", str(out_dir), *common, "--resume")

    assert len(losses(whole)) == 24
    assert losses(broken) == losses(whole)  # steps 9..24 recomputed after the resume, bit for bit
    final, resumed = torch.load(whole / "final.pt"), torch.load(broken / "final.pt")
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    # save_total_limit=2: two checkpoint-N pointer directories, and the job's retention keeps two steps
    assert sorted(p.name for p in out_dir.iterdir()) == ["checkpoint-16", "checkpoint-24"]
    pointer = read_pointer(str(out_dir / "checkpoint-24"))
    assert pointer is not None and (pointer.job, pointer.step) == ("hf", 24)
    assert (out_dir / "checkpoint-24" / "trainer_state.json").is_file()
    gc = daemon.cli("gc", "--job", "hf-whole", "--address", daemon.address)  # "hf" read step 8 just now: held
    assert gc.returncode == 0, gc.stderr
    assert ls(daemon, "hf-whole") == [16, 24]


@pytest.mark.timeout(120)
def test_a_new_trainer_in_a_used_output_dir_saves_to_a_version_of_the_job(daemon, short_tmp, caplog):
    out_dir = str(short_tmp / "run")
    make_trainer("hfv", out_dir, max_steps=8, address=daemon.address).train()
    with caplog.at_level(logging.WARNING, logger="ckpt.huggingface"):
        huggingface_train.main(  # the same script run again, as the example runs it
            ["--job", "hfv", "--output-dir", out_dir, "--max-steps", "8", "--address", daemon.address]
        )
    assert "job hfv holds steps up to 8 of another run" in caplog.text and "job hfv-v1" in caplog.text
    pointer = read_pointer(f"{out_dir}/checkpoint-8")
    assert pointer is not None and (pointer.job, pointer.step) == ("hfv-v1", 8)
    assert ls(daemon, "hfv") == [8] and ls(daemon, "hfv-v1") == [8]


@pytest.mark.timeout(120)
def test_a_checkpoint_the_plain_trainer_wrote_resumes_under_ckptd_trainer(daemon, short_tmp):
    out_dir = str(short_tmp / "run")
    plain = make_trainer("hfp", out_dir, max_steps=8, address=daemon.address)
    Trainer(model=tiny_gpt2(), args=plain.args, train_dataset=Tokens()).train()  # files, no ckptd.json
    assert read_pointer(f"{out_dir}/checkpoint-8") is None

    steps = StepCounter()
    resumed = make_trainer("hfp", out_dir, max_steps=16, address=daemon.address, callbacks=[steps])
    resumed.train(resume_from_checkpoint=True)
    assert (resumed.state.global_step, steps.run) == (16, 8)  # went on from step 8, not from 0
    pointer = read_pointer(f"{out_dir}/checkpoint-16")
    assert pointer is not None and (pointer.job, pointer.step) == ("hfp", 16)


@pytest.mark.timeout(240)
def test_an_accelerate_loop_killed_mid_run_resumes_from_ckptd_with_the_losses_of_an_uninterrupted_run(
    daemon, short_tmp
):
    common = ["--address", daemon.address, "--steps", "24"]
    whole, broken = short_tmp / "whole", short_tmp / "broken"
    run(ACCELERATE_EXAMPLE, "--job", "acc-whole", "--losses", str(whole), *common)
    run(ACCELERATE_EXAMPLE, "--job", "acc", "--losses", str(broken), *common, "--die-at", "12", killed=True)
    run(ACCELERATE_EXAMPLE, "--job", "acc", "--losses", str(broken), *common)

    assert len(losses(whole)) == 24
    assert losses(broken) == losses(whole)
    assert ls(daemon, "acc")[-1] == 24
