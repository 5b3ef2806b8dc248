"""torchtitan's CheckpointManager on ckptd (CkptdCheckpointManager) with a real daemon: kill -9, resume, same losses.

Most processes run examples/torchtitan_train.py: a tiny model with torchtitan's OptimizersContainer and
LRSchedulersContainer (on two ranks sharded by FSDP2, as torchtitan shards), checkpointed by the manager
torchtitan's Trainer builds from its config. One test runs examples/torchtitan_trainer.py: torchtitan's own
Trainer, its llama3 debug model, tokenizer and dataloader, on CPU. Skipped where torchtitan is not installed
(the test extra has it, and triton, which torchtitan's models import), that test also where its dataset stack or
triton is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import eventually
from torchrun import torchrun

pytest.importorskip("torchtitan", reason="torchtitan is not installed")

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_train.py"
TRAINER = EXAMPLE.with_name("torchtitan_trainer.py")
WORKER_TIMEOUT_S = 120
STEPS, INTERVAL, DIE_AT = 16, 4, 10  # saves at 4, 8, 12 and 16 (the last step's); killed after 10's


def run(out: Path, *args: str, killed: bool = False, example: Path = EXAMPLE) -> None:
    """Run the example to its end (or to its SIGKILL, when killed), its temporary files beside out."""
    # TMPDIR: a killed process's multiprocessing directory (/tmp/pymp-*, DCP's process executor) goes with the test's
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ADDRESS"} | {
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(out.parent),
    }
    command = [sys.executable, str(example), str(out), "--steps", str(STEPS), "--interval", str(INTERVAL), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout + done.stderr[-6000:]


def losses_by_process(out: Path, rank: int = 0) -> list[dict[int, float]]:
    """Return each of rank's processes' losses by step, in the order the processes ran."""
    files = sorted(out.glob(f"losses-rank{rank}-*.json"), key=lambda p: p.stat().st_mtime_ns)
    return [{int(k): v for k, v in json.loads(p.read_text()).items()} for p in files]


def ls(daemon, job: str) -> list[int]:
    out = daemon.cli("ls", "--job", job, "--json", "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    return sorted(item["step"] for item in json.loads(out.stdout))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_mode", ["async", "disabled", "async_with_pinned_mem"])
def test_a_torchtitan_run_killed_mid_run_resumes_from_ckptd_with_the_losses_of_an_uninterrupted_run(
    daemon, short_tmp, async_mode
):
    common = ["--address", daemon.address, "--async-mode", async_mode, "--keep-latest-k", "2"]
    whole, broken = short_tmp / "whole", short_tmp / "broken"
    run(whole, "--job", "titan-whole", *common)
    run(broken, "--job", "titan", *common, "--die-at", str(DIE_AT), killed=True)
    run(broken, "--job", "titan", *common)

    [reference] = losses_by_process(whole)
    first, resumed = losses_by_process(broken)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sorted(first) == list(range(1, DIE_AT + 1))
    assert sorted(resumed) == list(range(9, STEPS + 1))  # from step 8, the newest step saved before the kill
    assert first | resumed == reference  # every loss, the resumed steps' recomputed bit for bit
    final, final_resumed = torch.load(whole / "final.pt"), torch.load(broken / "final.pt")
    assert final.keys() == final_resumed.keys()
    assert all(torch.equal(final[k], final_resumed[k]) for k in final)
    # torchtitan's checkpoint.folder/step-N is the job's step N: nothing is written under the folder
    assert not (broken / "checkpoint").exists()
    # keep_latest_k=2 is the job's retention (a step loaded by the resume may be held a while longer)
    eventually(lambda: ls(daemon, "titan-whole") == [12, 16], what="titan-whole keeping its 2 newest steps")
    eventually(lambda: 4 not in ls(daemon, "titan"), what="titan's step 4 removed")


@pytest.mark.timeout(180)
def test_a_run_moved_onto_ckptd_resumes_from_torchtitans_own_step_directory_then_saves_to_ckptd(daemon, short_tmp):
    common = ["--address", daemon.address, "--keep-latest-k", "2"]
    whole, moved = short_tmp / "whole", short_tmp / "moved"
    run(whole, "--job", "titan-whole", *common)
    # torchtitan's own files, step-4 and step-8, each written before save() returned (async, step-8 could be cut)
    run(moved, "--stock", *common, "--async-mode", "disabled", "--die-at", str(DIE_AT), killed=True)
    assert sorted(p.name for p in (moved / "checkpoint").iterdir()) == ["step-4", "step-8"]
    run(moved, "--job", "titan-moved", *common)

    [reference] = losses_by_process(whole)
    first, resumed = losses_by_process(moved)
    assert sorted(resumed) == list(range(9, STEPS + 1))  # from the folder's step-8, the job holding no step
    assert first | resumed == reference
    eventually(lambda: ls(daemon, "titan-moved") == [12, 16], what="titan-moved's saves on ckptd")
    assert sorted(p.name for p in (moved / "checkpoint").iterdir()) == ["step-4", "step-8"]  # left as they were


@pytest.mark.timeout(300)
def test_two_fsdp2_ranks_under_torchrun_killed_mid_run_resume_with_the_losses_of_an_uninterrupted_run(
    daemon, short_tmp
):
    common = ["--steps", str(STEPS), "--interval", str(INTERVAL), "--address", daemon.address, "--async-mode", "async"]
    whole, broken = short_tmp / "whole", short_tmp / "broken"
    torchrun(2, EXAMPLE, str(whole), "--job", "titan2-whole", *common, env={})
    with pytest.raises(AssertionError, match="torchrun failed"):  # both ranks SIGKILL themselves after step 10
        torchrun(2, EXAMPLE, str(broken), "--job", "titan2", *common, "--die-at", str(DIE_AT), env={})
    torchrun(2, EXAMPLE, str(broken), "--job", "titan2", *common, env={})

    for rank in (0, 1):  # each rank trains on batches of its own: its losses are its shard's
        [reference] = losses_by_process(whole, rank)
        first, resumed = losses_by_process(broken, rank)
        assert sorted(first) == list(range(1, DIE_AT + 1))
        assert sorted(resumed) == list(range(9, STEPS + 1))
        assert first | resumed == reference
    final, final_resumed = torch.load(whole / "final.pt"), torch.load(broken / "final.pt")
    assert all(torch.equal(final[k], final_resumed[k]) for k in final)
    [step] = [
        item
        for item in json.loads(daemon.cli("ls", "--job", "titan2", "--json", "--address", daemon.address).stdout)
        if item["step"] == 16
    ]
    assert step["world_size"] == 2


def trainer_losses_by_process(out: Path) -> list[dict[int, float]]:
    """Return the losses torchtitan's Trainer logged, by step, for each process in the order they ran."""
    files = sorted(out.glob("losses-*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    return [{row["step"]: row["loss"] for row in map(json.loads, p.read_text().splitlines())} for p in files]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_mode", ["async", "disabled", "async_with_pinned_mem"])
def test_torchtitans_own_trainer_killed_mid_run_resumes_from_ckptd_with_the_losses_of_an_uninterrupted_run(
    daemon, short_tmp, async_mode, monkeypatch
):
    for module in ("triton", "datasets", "torchdata", "tokenizers"):
        pytest.importorskip(module, reason=f"torchtitan's Trainer needs {module}")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(short_tmp / "datasets-cache"))  # the dataset's cache, not ~/.cache
    common = ["--address", daemon.address, "--async-mode", async_mode, "--keep-latest-k", "2"]
    whole, broken = short_tmp / "whole", short_tmp / "broken"
    run(whole, "--job", "trainer-whole", *common, example=TRAINER)
    run(broken, "--job", "trainer", *common, "--die-at", str(DIE_AT), killed=True, example=TRAINER)
    run(broken, "--job", "trainer", *common, example=TRAINER)

    [reference] = trainer_losses_by_process(whole)
    first, resumed = trainer_losses_by_process(broken)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sorted(first) == list(range(1, DIE_AT + 1))
    assert sorted(resumed) == list(range(9, STEPS + 1))  # from step 8 (model, optimizer, schedule, data position)
    assert first | resumed == reference  # bit for bit: the resumed steps saw the same weights and the same batches
    assert not (broken / "checkpoint").exists()
    eventually(lambda: ls(daemon, "trainer-whole") == [12, 16], what="trainer-whole keeping its 2 newest steps")
    # step 8, loaded by the resume, may be held a while longer
    eventually(lambda: 4 not in ls(daemon, "trainer") and {12, 16} <= set(ls(daemon, "trainer")), what="trainer's")
