"""CkptdCheckpointEngine with a real daemon and a real DeepSpeed engine (ZeRO 1, gloo on CPU): kill -9, resume."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

import torch  # noqa: E402
from ckpt.deepspeed import CkptdCheckpointEngine, Pointer, read_pointer  # noqa: E402
from ckpt_core.errors import InvalidArgument  # noqa: E402
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_train.py"
WORKER_TIMEOUT_S = 180  # DeepSpeed builds its CPU shared-memory op once per machine (about a minute), then caches it


def run(*args: str, killed: bool = False) -> None:
    """Run the example to its end (or to its SIGKILL, when killed), as one rank of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
    )
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-6000:]


def losses(out: Path) -> dict[int, float]:
    """Return every step's loss over the runs, the later run's for a step run twice."""
    merged: dict[int, float] = {}
    for path in sorted(out.glob("losses-*.json"), key=lambda p: p.stat().st_mtime_ns):
        merged |= {int(k): v for k, v in json.loads(path.read_text()).items()}
    return merged


def ls(daemon, job: str) -> list[int]:
    out = daemon.cli("ls", "--job", job, "--json", "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    return sorted(item["step"] for item in json.loads(out.stdout))


@pytest.mark.timeout(420)
def test_a_deepspeed_run_killed_mid_run_resumes_from_ckptd_with_the_losses_of_an_uninterrupted_run(daemon, short_tmp):
    common = ["--address", daemon.address, "--steps", "24", "--save-every", "8"]
    whole, broken = short_tmp / "whole", short_tmp / "broken"
    run("--job", "ds-whole", "--save-dir", str(short_tmp / "w"), "--losses", str(whole), *common)
    save_dir = short_tmp / "b"
    args = ["--job", "ds", "--save-dir", str(save_dir), "--losses", str(broken), *common]
    run(*args, "--die-at", "12", killed=True)
    assert (save_dir / "latest").read_text() == "global_step8"
    pointer = read_pointer(str(save_dir / "global_step8" / "mp_rank_00_model_states.pt"))
    assert pointer == Pointer("ds", 8, 0, 1, "mp_rank_00_model_states.pt")  # a pointer, not DeepSpeed's torch file
    run(*args)

    assert len(losses(whole)) == 24
    assert losses(broken) == losses(whole)  # steps 9..24 recomputed after the resume, bit for bit
    assert ls(daemon, "ds") == [8, 16, 24] and ls(daemon, "ds-whole") == [8, 16, 24]
    assert sorted(p.name for p in (save_dir / "global_step24").iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",  # ZeRO's per-rank optimizer file: the same step's shard
    ]


def test_a_tag_that_ends_in_no_number_is_refused_before_anything_is_saved(daemon, short_tmp):
    engine = CkptdCheckpointEngine(job="ds-tag", address=daemon.address)
    with pytest.raises(InvalidArgument, match=r"tag 'best' ends in no number.*tag=None"):
        engine.create(CheckpointCommitInfo(tag="best", save_dir=str(short_tmp), save_latest=True))
    engine.close()


def test_save_commit_load_round_trips_bit_for_bit_and_nothing_is_saved_before_commit(daemon, short_tmp):
    tag_dir = short_tmp / "global_step3"
    tag_dir.mkdir()
    info = CheckpointCommitInfo(tag="global_step3", save_dir=str(short_tmp), save_latest=True)
    weights = {"module": {"w": torch.randn(5, 3)[:, 1], "b": torch.arange(4, dtype=torch.bfloat16)}, "n": 3}
    optim = {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.randn(7)}}}, "ds_version": "x"}
    engine = CkptdCheckpointEngine(job="ds-rt", address=daemon.address)
    engine.create(info)
    engine.save(weights, str(tag_dir / "mp_rank_00_model_states.pt"))
    engine.save(optim, str(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert ls(daemon, "ds-rt") == [] and not list(tag_dir.iterdir())  # nothing before commit: no half step
    engine.commit(info)
    engine.last_handle.wait("nvme")
    engine.close()

    again = CkptdCheckpointEngine(job="ds-rt", address=daemon.address)
    model_file = again.load(str(tag_dir / "mp_rank_00_model_states.pt"), map_location="cpu")
    optim_file = again.load(str(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"), map_location="cpu")
    assert torch.equal(model_file["module"]["w"], weights["module"]["w"]) and model_file["n"] == 3
    assert torch.equal(model_file["module"]["b"], weights["module"]["b"])
    exp_avg = optim_file["optimizer_state_dict"]["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, optim["optimizer_state_dict"]["state"][0]["exp_avg"])
    torch.save({"plain": 1}, tag_dir / "plain.pt")  # a file DeepSpeed's own engine wrote is read as such
    assert again.load(str(tag_dir / "plain.pt")) == {"plain": 1}
    again.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_two_ranks_resumed_from_an_older_tag_recompute_its_steps_bit_for_bit_and_save_a_new_line(
    daemon, short_tmp, zero_stage
):
    """ZeRO 0: rank 1 saves no file and loads rank 0's; ZeRO 1: each rank also its own optimizer file."""
    from torchrun import torchrun

    first, again, save_dir = short_tmp / "first", short_tmp / "again", short_tmp / "s"
    common = ["--job", "ds2", "--save-dir", str(save_dir), "--address", daemon.address, "--steps", "16"]
    common += ["--zero-stage", str(zero_stage)]
    torchrun(2, EXAMPLE, *common, "--losses", str(first), env={"DS_ACCELERATOR": "cpu"})
    (save_dir / "latest").write_text("global_step8")  # as if step 16 had never been saved: resume from step 8
    torchrun(2, EXAMPLE, *common, "--losses", str(again), env={"DS_ACCELERATOR": "cpu"})

    recomputed = losses(again)
    assert sorted(recomputed) == list(range(9, 17))
    assert recomputed == {step: loss for step, loss in losses(first).items() if step > 8}
    assert ls(daemon, "ds2") == [8, 16]  # step 16 saved again by both ranks, on the line that continues from step 8
    if zero_stage == 0:
        assert sorted(p.name for p in (save_dir / "global_step16").iterdir()) == ["mp_rank_00_model_states.pt"]
        return
    optim = [
        read_pointer(str(save_dir / "global_step16" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")) for r in (0, 1)
    ]
    assert [(p.rank, p.world_size) for p in optim if p is not None] == [(0, 2), (1, 2)]


def test_a_commit_the_daemon_skips_writes_no_pointer_and_says_why(daemon, short_tmp, caplog):
    engine = CkptdCheckpointEngine(job="ds-skip", address=daemon.address)
    for save_dir in (short_tmp / "first", short_tmp / "second"):
        (save_dir / "global_step5").mkdir(parents=True)
        info = CheckpointCommitInfo(tag="global_step5", save_dir=str(save_dir), save_latest=True)
        engine.create(info)
        engine.save({"w": torch.ones(3)}, str(save_dir / "global_step5" / "mp_rank_00_model_states.pt"))
        with caplog.at_level(logging.WARNING, logger="ckpt.deepspeed"):
            saved = engine.commit(info)
        if saved:
            engine.last_handle.wait("nvme")
    engine.close()
    assert not saved  # step 5 is complete: a save of it again is skipped
    assert "tag global_step5 (ds-skip step 5) was not saved on rank 0" in caplog.text
    assert not list((short_tmp / "second" / "global_step5").iterdir())


def test_a_run_that_loaded_nothing_saves_to_a_version_of_a_used_job_and_a_load_continues_the_loaded_one(
    daemon, short_tmp, caplog
):
    def save(engine: CkptdCheckpointEngine, save_dir: Path, tag: str) -> Pointer | None:
        (save_dir / tag).mkdir(parents=True)
        info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True)
        engine.create(info)
        engine.save({"w": torch.ones(2)}, str(save_dir / tag / "mp_rank_00_model_states.pt"))
        assert engine.commit(info)
        engine.last_handle.wait("nvme")
        return read_pointer(str(save_dir / tag / "mp_rank_00_model_states.pt"))

    model_file = "mp_rank_00_model_states.pt"
    with CkptdCheckpointEngine(job="dsv", address=daemon.address) as first:
        assert save(first, short_tmp / "a", "global_step1") == Pointer("dsv", 1, 0, 1, model_file)
    with (
        caplog.at_level(logging.WARNING, logger="ckpt.deepspeed"),
        CkptdCheckpointEngine(job="dsv", address=daemon.address) as rerun,
    ):  # the same script run again in the same directory, without load_checkpoint
        assert save(rerun, short_tmp / "b", "global_step1") == Pointer("dsv-v1", 1, 0, 1, model_file)
    assert "job dsv holds steps (newest 1) of a run this one did not load: saving to dsv-v1" in caplog.text
    with CkptdCheckpointEngine(job="dsv", address=daemon.address) as resumed:
        resumed.load(str(short_tmp / "b" / "global_step1" / model_file))
        assert save(resumed, short_tmp / "b", "global_step2") == Pointer("dsv-v1", 2, 0, 1, model_file)
    assert ls(daemon, "dsv") == [1] and ls(daemon, "dsv-v1") == [1, 2]


KILLED_BEFORE_COMMIT = """
import os, signal, sys, torch
from ckpt.deepspeed import CkptdCheckpointEngine
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo
save_dir, address = sys.argv[1], sys.argv[2]
engine = CkptdCheckpointEngine(job="ds-kill", address=address)
os.makedirs(os.path.join(save_dir, "global_step4"))
info = CheckpointCommitInfo(tag="global_step4", save_dir=save_dir, save_latest=True)
engine.create(info)
engine.save({"w": torch.ones(1000)}, os.path.join(save_dir, "global_step4", "mp_rank_00_model_states.pt"))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_between_save_and_commit_leaves_no_step_and_no_pointer(daemon, short_tmp):
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ADDRESS"} | {"DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_COMMIT, str(short_tmp), daemon.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert not list((short_tmp / "global_step4").iterdir())
    assert ls(daemon, "ds-kill") == []
    with CkptdCheckpointEngine(job="ds-kill", address=daemon.address) as engine:  # the job saves on as new
        info = CheckpointCommitInfo(tag="global_step4", save_dir=str(short_tmp), save_latest=True)
        engine.create(info)
        engine.save({"w": torch.zeros(3)}, str(short_tmp / "global_step4" / "mp_rank_00_model_states.pt"))
        assert engine.commit(info)
        engine.last_handle.wait("nvme")
    assert ls(daemon, "ds-kill") == [4]
