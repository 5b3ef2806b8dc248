"""CkptdCheckpointIO under a real Trainer, as Lightning users run it: saves after fit, reruns, retention."""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path

import pytest
import torch
from ckpt.lightning import read_pointer
from lightning.pytorch.plugins.io import AsyncCheckpointIO

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_train import TinyRegressor, data, make_trainer

pytestmark = pytest.mark.e2e

JOB = "lt"
# ModelCheckpoint keeps its best k, which need not be the newest: retention by age must not drop them.
RETAIN_ALL = "[retention]\nnvme = 0\n"


def ckpt_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckpt-")]


def ls(daemon, job: str) -> list[int]:
    out = daemon.cli("ls", "--job", job, "--json", "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    return sorted(item["step"] for item in json.loads(out.stdout))


@pytest.mark.timeout(120)
def test_a_save_after_fit_is_a_torch_checkpoint_of_that_moment_when_it_returns(make_daemon, short_tmp):
    daemon = make_daemon(RETAIN_ALL).start()
    trainer = make_trainer(JOB, str(short_tmp / "run"), max_epochs=1, address=daemon.address)
    trainer.fit(TinyRegressor(), data())  # 8 steps; ModelCheckpoint saved step 8 with epoch 0 inside fit
    path = short_tmp / "final.ckpt"
    trainer.save_checkpoint(path)

    saved = torch.load(path, weights_only=True)  # the torch file already, not the pointer
    assert (saved["global_step"], saved["epoch"]) == (8, 1)  # the epoch of now, not of the save inside fit
    assert read_pointer(str(path)).step == 9  # a step of its own beside fit's step 8
    assert ckpt_threads() == []  # and nothing of the plugin's is left running


@pytest.mark.timeout(120)
def test_a_save_through_async_checkpoint_io_leaves_no_thread_once_the_wrapper_is_torn_down(daemon, short_tmp):
    trainer = make_trainer(JOB, str(short_tmp / "run"), max_epochs=1, address=daemon.address)
    trainer.strategy.checkpoint_io = AsyncCheckpointIO(trainer.strategy.checkpoint_io)
    trainer.fit(TinyRegressor(), data())  # Lightning tears down the wrapper alone, never the plugin in it
    assert ckpt_threads() == []
    assert torch.load(short_tmp / "run" / "last.ckpt", weights_only=True)["global_step"] == 8


@pytest.mark.timeout(180)
def test_a_new_trainer_in_a_used_directory_saves_a_version_of_the_job_and_a_resumed_one_continues_it(
    make_daemon, short_tmp, caplog
):
    daemon = make_daemon(RETAIN_ALL).start()
    dirpath = str(short_tmp / "run")
    make_trainer(JOB, dirpath, max_epochs=1, address=daemon.address).fit(TinyRegressor(), data())
    assert read_pointer(f"{dirpath}/last.ckpt").job == JOB

    with caplog.at_level(logging.WARNING, logger="ckpt.lightning"):  # the same script run again
        make_trainer(JOB, dirpath, max_epochs=1, address=daemon.address).fit(TinyRegressor(), data())
    assert f"job {JOB} holds steps up to 8 of another run" in caplog.text and f"job {JOB}-v1" in caplog.text
    rerun = read_pointer(f"{dirpath}/last-v1.ckpt")  # Lightning's name for the new run's last.ckpt
    assert (rerun.job, rerun.step) == (f"{JOB}-v1", 8)
    assert ls(daemon, JOB) == [4, 8] and ls(daemon, f"{JOB}-v1") == [4, 8]

    resumed = make_trainer(JOB, dirpath, max_epochs=2, address=daemon.address)
    resumed.fit(TinyRegressor(), data(), ckpt_path=f"{dirpath}/last-v1.ckpt")
    assert resumed.global_step == 16
    assert ls(daemon, f"{JOB}-v1") == [4, 8, 12, 16] and ls(daemon, JOB) == [4, 8]  # it went on with its version
    assert torch.load(f"{dirpath}/last-v1.ckpt", weights_only=True)["global_step"] == 16


@pytest.mark.timeout(120)
def test_retention_keeps_its_count_of_a_lightning_jobs_steps(make_daemon, short_tmp):
    daemon = make_daemon("[retention]\nnvme = 3\n").start()
    trainer = make_trainer(JOB, str(short_tmp / "run"), max_epochs=3, address=daemon.address)
    trainer.fit(TinyRegressor(), data())  # 6 saves, each read back by the plugin for its torch file
    assert trainer.global_step == 24
    out = daemon.cli("gc", "--job", JOB, "--address", daemon.address)  # one pass, as the next save would make
    assert out.returncode == 0, out.stderr
    assert ls(daemon, JOB) == [16, 20, 24]
