"""CkptdCheckpointIO end to end: real Lightning training on CPU (one process, then DDP on gloo) into a real ckptd."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import ckpt
import lightning as L
import pytest
import torch
from ckpt.lightning import CkptdCheckpointIO, Pointer, read_pointer, write_pointer
from ckpt.lightning_files import POINTER_KEY
from ckpt.transport import DaemonClient
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from conftest import eventually
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from states import Planted, assert_same
from torchrun import torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_train import TinyRegressor, data, make_trainer

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).with_name("lightning_worker.py")
JOB = "lightning"
# ModelCheckpoint keeps its best k, which need not be the newest: retention by age must not drop them.
RETAIN_ALL = "[retention]\nnvme = 0\n"
WORKER_TIMEOUT_S = 120


def run_worker(
    daemon,
    out: Path,
    dirpath: Path,
    max_epochs: int,
    ranks: int = 1,
    job: str = JOB,
    die_at: int | None = None,
    stateful_data: bool = False,
) -> Path:
    """Fit the example under the worker's probes, in new processes (torchrun for ranks > 1); return out.

    With die_at, the one process must end by its own SIGKILL once that step has trained.
    """
    args = ["--job", job, "--address", daemon.address, "--dirpath", str(dirpath), "--max-epochs", str(max_epochs)]
    if die_at is not None:
        args += ["--die-at", str(die_at)]
    if stateful_data:
        args.append("--stateful-data")
    if ranks > 1:
        torchrun(ranks, WORKER, str(out), *args, "--devices", str(ranks), env={}, timeout_s=WORKER_TIMEOUT_S)
        return out
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(WORKER), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    assert run.returncode == (0 if die_at is None else -signal.SIGKILL), run.stdout + run.stderr[-6000:]
    return out


def losses(out: Path) -> dict[int, float]:
    """Return every step's loss over the worker's processes, the later process's for a step trained twice."""
    merged: dict[int, float] = {}
    for path in sorted(out.glob("losses-*.json"), key=lambda p: p.stat().st_mtime_ns):
        merged |= {int(k): v for k, v in json.loads(path.read_text()).items()}
    return merged


def pointers(dirpath: Path) -> dict[str, Pointer]:
    """Return the checkpoint files ModelCheckpoint left in dirpath, by name, each read as a pointer."""
    found = {}
    for p in sorted(dirpath.iterdir()):
        pointer = read_pointer(str(p))
        assert pointer is not None, f"{p} is not a pointer"
        found[p.name] = pointer
    return found


def ls(daemon) -> dict[int, dict]:
    out = daemon.cli("ls", "--job", JOB, "--json", "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    return {item["step"]: item for item in json.loads(out.stdout)}


def saves_made(daemon) -> int:
    out = daemon.cli("status", "--json", "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["counters"]["saves"]


def saved(out: Path, global_step: int) -> dict:
    return torch.load(out / f"saved-{global_step}.pt", weights_only=False)


def assert_restored(restored: dict, at_save: dict) -> None:
    """Assert a resumed run's model and optimizer are bit for bit the checkpoint dict's at save time."""
    assert restored["global_step"] == at_save["global_step"]
    assert_same(restored["state_dict"], at_save["state_dict"], "state_dict")
    assert_same(restored["optimizer"], at_save["optimizer_states"][0], "optimizer")


@pytest.mark.timeout(180)
def test_a_lightning_run_checkpoints_into_ckptd_and_resumes_bit_for_bit(make_daemon, short_tmp):
    daemon = make_daemon(RETAIN_ALL).start()
    dirpath = short_tmp / "checkpoints"
    first = run_worker(daemon, short_tmp / "first", dirpath, max_epochs=3)  # 8 batches an epoch, a save every 4

    steps = ls(daemon)
    assert sorted(steps) == [4, 8, 12, 16, 20, 24]  # the ckptd step is the global step
    assert all(item["world_size"] == 1 and "nvme" in item["tiers"] for item in steps.values())
    run = json.loads((first / "run.json").read_text())
    assert run["saves"] > len(steps)  # the top-k file and last.ckpt of a step: one ckptd step
    assert saves_made(daemon) == len(steps)
    files = pointers(dirpath)
    assert sorted(str(dirpath / name) for name in files if name != "last.ckpt") == run["best_k"]
    assert len(files) == 3 and files["last.ckpt"].step == 24
    removed = set(run["ever_best_k"]) - set(run["best_k"])
    assert removed and not any(Path(p).exists() for p in removed)  # top-k removal removed their pointers
    with ckpt.Checkpointer(job=JOB, address=daemon.address) as c:
        for name, pointer in files.items():
            assert pointer.job == JOB and pointer.step == pointer.global_step
            assert name == "last.ckpt" or name.endswith(f"-step={pointer.step}.ckpt")
            stored = c.load(pointer.step)
            at_save = saved(first, pointer.global_step)
            assert_same(stored["state_dict"], at_save["state_dict"], f"{name} state_dict")
            assert_same(stored["optimizer_states"], at_save["optimizer_states"], f"{name} optimizer_states")

    second = run_worker(daemon, short_tmp / "second", dirpath, max_epochs=4)  # fit(ckpt_path="last")
    assert_restored(torch.load(second / "restored-rank0.pt", weights_only=False), saved(first, 24))
    assert sorted(ls(daemon)) == [4, 8, 12, 16, 20, 24, 28, 32]
    files = pointers(dirpath)
    assert len(files) == 3 and files["last.ckpt"].step == 32  # the resumed run went on with the same files


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stateful_data", "die_at", "resumed_from"),
    [
        pytest.param(False, 10, 8, id="plain-DataLoader-killed-after-an-epoch"),
        pytest.param(True, 14, 12, id="StatefulDataLoader-killed-mid-epoch"),
    ],
)
def test_a_lightning_run_killed_mid_run_resumes_from_ckptd_with_the_losses_of_an_uninterrupted_run(
    make_daemon, short_tmp, stateful_data, die_at, resumed_from
):
    """8 batches an epoch, a save every 4; the kill comes 2 steps after a save.

    A plain DataLoader has no position to save, so Lightning starts an epoch over on a resume
    (stock torch files too): its kill falls just after an epoch. A StatefulDataLoader's position
    is in the checkpoint dict, and ckptd must carry it for a resume mid-epoch to see the same batches.
    """
    daemon = make_daemon(RETAIN_ALL).start()
    options = {"max_epochs": 3, "stateful_data": stateful_data}
    whole = run_worker(daemon, short_tmp / "whole", short_tmp / "w", job="whole", **options)
    dirpath = short_tmp / "b"
    broken = run_worker(daemon, short_tmp / "broken", dirpath, die_at=die_at, **options)
    assert max(losses(broken)) == die_at  # it trained up to the kill and no further
    assert read_pointer(str(dirpath / "last.ckpt")).step == resumed_from  # the save of die_at never began
    run_worker(daemon, short_tmp / "broken", dirpath, **options)  # fit(ckpt_path="last")

    restored = torch.load(broken / "restored-rank0.pt", weights_only=False)
    assert restored["global_step"] == resumed_from
    assert len(losses(whole)) == 24
    assert losses(broken) == losses(whole)  # steps after the resume recomputed, bit for bit
    final_whole = torch.load(short_tmp / "w" / "last.ckpt", weights_only=True)
    final_broken = torch.load(dirpath / "last.ckpt", weights_only=True)
    assert final_whole["global_step"] == final_broken["global_step"] == 24
    assert_same(final_broken["state_dict"], final_whole["state_dict"], "final state_dict")
    assert_same(final_broken["optimizer_states"], final_whole["optimizer_states"], "final optimizer_states")


@pytest.mark.timeout(240)
def test_ddp_saves_from_rank_0_and_every_rank_resumes_the_same_state(make_daemon, short_tmp):
    daemon = make_daemon(RETAIN_ALL).start()
    dirpath = short_tmp / "checkpoints"
    first = run_worker(daemon, short_tmp / "first", dirpath, max_epochs=2, ranks=2)  # 4 batches a rank an epoch

    steps = ls(daemon)
    assert sorted(steps) == [4, 8] and all(item["world_size"] == 1 for item in steps.values())  # rank 0's whole state
    assert pointers(dirpath)["last.ckpt"].step == 8

    second = run_worker(daemon, short_tmp / "second", dirpath, max_epochs=3, ranks=2)
    for rank in (0, 1):
        assert_restored(torch.load(second / f"restored-rank{rank}.pt", weights_only=False), saved(first, 8))
    assert "called on rank 1" in (second / "refused-rank1.txt").read_text()
    assert sorted(ls(daemon)) == [4, 8, 12]


def test_the_same_tensors_at_the_same_global_step_write_only_another_pointer(make_daemon, short_tmp):
    daemon = make_daemon(RETAIN_ALL).start()
    io = CkptdCheckpointIO(job=JOB, address=daemon.address)
    top, last, final = (str(short_tmp / name) for name in ("epoch=0-step=5.ckpt", "last.ckpt", "final.ckpt"))
    w = torch.arange(10.0)
    io.save_checkpoint({"global_step": 5, "w": w, "last_model_path": ""}, top)
    io.save_checkpoint({"global_step": 5, "w": w[:], "last_model_path": last}, last)  # a view afresh, as state_dict()
    assert read_pointer(last) == read_pointer(top) == Pointer(JOB, 5, 5, f"unix:{daemon.address}")
    w.mul_(2)  # changed in place at the same global step (say, an averaging callback at the end of fit)
    io.save_checkpoint({"global_step": 5, "w": w, "last_model_path": last}, final)
    assert read_pointer(final) == Pointer(JOB, 6, 5, f"unix:{daemon.address}")  # a step of its own
    io.teardown()
    assert saves_made(daemon) == 2
    assert_same(io.load_checkpoint(last), {"global_step": 5, "w": torch.arange(10.0), "last_model_path": ""})
    assert_same(io.load_checkpoint(final)["w"], torch.arange(10.0) * 2)


def test_a_new_run_under_a_used_job_saves_to_a_version_and_a_resumed_run_continues_from_its_checkpoint(
    make_daemon, short_tmp
):
    daemon = make_daemon(RETAIN_ALL).start()
    first = CkptdCheckpointIO(job=JOB, address=daemon.address)
    for global_step in (5, 7):
        first.save_checkpoint({"global_step": global_step, "w": torch.ones(4)}, str(short_tmp / f"{global_step}.ckpt"))
    first.teardown()
    fresh = CkptdCheckpointIO(job=JOB, address=daemon.address)  # a new run under the same job name
    fresh.save_checkpoint({"global_step": 3, "w": torch.zeros(4)}, str(short_tmp / "3.ckpt"))
    assert read_pointer(str(short_tmp / "3.ckpt")) == Pointer(f"{JOB}-v1", 3, 3, f"unix:{daemon.address}")
    fresh.teardown()
    resumed = CkptdCheckpointIO(job=JOB, address=daemon.address)  # Trainer.fit(ckpt_path=".../5.ckpt")
    assert resumed.load_checkpoint(str(short_tmp / "5.ckpt"))["global_step"] == 5
    for global_step in (6, 7):  # a new line from step 5: the old run's 7 is superseded, then saved again
        state = {"global_step": global_step, "w": torch.full((4,), float(-global_step))}
        resumed.save_checkpoint(state, str(short_tmp / f"{global_step}.ckpt"))
        pointer = read_pointer(str(short_tmp / f"{global_step}.ckpt"))
        assert pointer == Pointer(JOB, global_step, global_step, f"unix:{daemon.address}")
        if global_step == 6:
            eventually(lambda: ls(daemon).get(7, {}).get("superseded") is True, what="the old run's 7 superseded")
    resumed.teardown()
    assert_same(resumed.load_checkpoint(str(short_tmp / "7.ckpt")), {"global_step": 7, "w": torch.full((4,), -7.0)})
    resumed.teardown()
    assert sorted(ls(daemon)) == [5, 6, 7] and not any(s["superseded"] for s in ls(daemon).values())


def test_a_pointer_to_a_step_ckptd_no_longer_holds_names_path_job_and_step(daemon, short_tmp):
    path = str(short_tmp / "gone.ckpt")
    write_pointer(path, Pointer(JOB, 41, 40, f"unix:{daemon.address}"))
    io = CkptdCheckpointIO(job="other", address=daemon.address)
    with pytest.raises(ckpt.NotFound, match=rf"{path} names step 41 \(global step 40\) of ckptd job {JOB}"):
        io.load_checkpoint(path)


def test_a_save_ckptd_skips_writes_no_pointer_and_leaves_the_older_one(make_daemon, short_tmp, caplog):
    daemon = make_daemon(f'policy = "skip"\nbudget_bytes = {8 << 20}\n').start()  # lands in [staging]
    io = CkptdCheckpointIO(job=JOB, address=daemon.address)
    last, top = short_tmp / "last.ckpt", short_tmp / "epoch=0-step=1.ckpt"
    io.save_checkpoint({"global_step": 0, "w": torch.ones(8)}, str(last))
    held = DaemonClient(daemon.address)  # a rank of another job in the middle of its copy: 6 of the 8 MiB
    try:
        assert not _reserve(held, 6 << 20).skipped
        for path in (top, last):
            io.save_checkpoint({"global_step": 1, "w": torch.ones(1 << 20)}, str(path))  # 4 MiB: no room
            assert f"global step 1 was not saved, so {path} is not written" in caplog.text
    finally:
        held.close()
    io.teardown()
    assert not top.exists()
    assert read_pointer(str(last)) == Pointer(JOB, 0, 0, f"unix:{daemon.address}")
    assert_same(io.load_checkpoint(str(last)), {"global_step": 0, "w": torch.ones(8)})


def _reserve(client: DaemonClient, size_bytes: int) -> pb.ReserveReply:
    shard = pb.ShardId(job="other", step=1, rank=0, world_size=1)
    return client.call("Reserve", pb.ReserveRequest(shard=shard, size_bytes=size_bytes))


def test_teardown_raises_a_save_that_failed_in_the_background(make_daemon, short_tmp, small_disk):
    daemon = make_daemon(root=small_disk).start()
    io = CkptdCheckpointIO(job=JOB, address=daemon.address)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(4 << 20)}, str(short_tmp / "big.ckpt"))  # 16 MiB
    assert (short_tmp / "big.ckpt").exists()  # written once the copy was committed, before the flush
    with pytest.raises(ckpt.SaveFailed, match="No space left on device"):
        io.teardown()
    io.teardown()  # raised once


class _StartedAt(L.Callback):
    """Remember the global step a fit started from (after a resume restored it)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.global_step = trainer.global_step


@pytest.mark.timeout(240)
def test_the_files_at_lightnings_paths_are_torch_checkpoints_once_durable(make_daemon, short_tmp, caplog):
    daemon = make_daemon(RETAIN_ALL).start()
    dirpath = short_tmp / "checkpoints"
    first = run_worker(daemon, short_tmp / "first", dirpath, max_epochs=3)  # its teardown waited for the files
    files = pointers(dirpath)  # each file still names its ckptd step
    assert sorted(files) and not list(dirpath.glob("*.partial"))
    for name, pointer in files.items():
        opened = torch.load(dirpath / name)  # torch's own default (weights_only=True)
        at_save = saved(first, pointer.global_step)
        assert opened["global_step"] == pointer.global_step
        assert_same(opened["state_dict"], at_save["state_dict"], f"{name} state_dict")
        assert_same(opened["optimizer_states"], at_save["optimizer_states"], f"{name} optimizer_states")
        assert json.loads(opened[POINTER_KEY]) == json.loads(pointer.to_json())
    last = dirpath / "last.ckpt"
    assert_same(pl_load(last)["state_dict"], saved(first, 24)["state_dict"], "pl_load")
    model = TinyRegressor.load_from_checkpoint(last)
    assert_same(model.state_dict(), saved(first, 24)["state_dict"], "load_from_checkpoint")

    # Lightning's own CheckpointIO resumes from the file: no ckptd in this Trainer at all.
    started = _StartedAt()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=4,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[started],
        default_root_dir=short_tmp,
    )
    trainer.fit(TinyRegressor(), data(), ckpt_path=str(last))
    assert started.global_step == 24 and trainer.global_step == 32

    # The plugin reads the step from ckptd; where ckptd holds it no more (a node that lost it), from the file.
    elsewhere = make_daemon(name="elsewhere").start()
    restored = CkptdCheckpointIO(job=JOB, address=elsewhere.address).load_checkpoint(last)
    assert f"ckptd holds step 24 of {JOB} no more: reading {last}" in caplog.text
    assert POINTER_KEY not in restored and restored["global_step"] == 24
    assert_same(restored["state_dict"], saved(first, 24)["state_dict"], "the file, read by the plugin")


def test_a_plugin_given_no_job_loads_a_pointer_and_saves_on_in_its_job(daemon, short_tmp, monkeypatch):
    monkeypatch.delenv("CKPT_JOB", raising=False)
    path = short_tmp / "last.ckpt"
    io = CkptdCheckpointIO(job=JOB, address=daemon.address, torch_files=False)
    io.save_checkpoint({"global_step": 3, "w": torch.arange(3.0)}, path, storage_options={"ignored": True})
    io.teardown()
    assert read_pointer(str(path)) is not None and path.read_bytes().startswith(b"{")  # torch_files=False

    resumed = CkptdCheckpointIO(address=daemon.address)
    assert_same(resumed.load_checkpoint(path), {"global_step": 3, "w": torch.arange(3.0)})
    assert resumed.job == JOB
    resumed.save_checkpoint({"global_step": 4, "w": torch.ones(3)}, path)
    resumed.teardown()
    assert sorted(ls(daemon)) == [3, 4]


def test_a_weights_only_load_of_a_pointer_reads_its_step_with_the_allow_list(daemon, short_tmp):
    marker = short_tmp / "ran"
    io = CkptdCheckpointIO(job=JOB, address=daemon.address, torch_files=False)
    clean = {"global_step": 3, "state_dict": {"w": torch.arange(3.0)}, "hyper_parameters": {"lr": 0.1}}
    io.save_checkpoint(clean, short_tmp / "clean.ckpt")
    planted = {"global_step": 4, "state_dict": {"w": torch.ones(3)}, "x": Planted(marker)}
    io.save_checkpoint(planted, short_tmp / "x.ckpt")
    io.teardown()

    resumed = CkptdCheckpointIO(job=JOB, address=daemon.address)
    assert_same(resumed.load_checkpoint(short_tmp / "clean.ckpt", weights_only=True), clean)
    with pytest.raises(ckpt.UnsafeCheckpoint, match=r"holds builtins\.exec"):
        resumed.load_checkpoint(short_tmp / "x.ckpt", weights_only=True)
    assert not marker.exists()
    resumed.load_checkpoint(short_tmp / "x.ckpt")  # weights_only None: in full, as Lightning's None meant before
    assert marker.exists()
    resumed.teardown()


def _ckpt_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckpt-")]


class _Fails(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("training failed")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("how", ["called directly", "in AsyncCheckpointIO"])
def test_no_ckpt_thread_outlives_a_plugin_whose_teardown_is_never_called(daemon, short_tmp, how):
    io = CkptdCheckpointIO(job=JOB, address=daemon.address)
    if how == "called directly":
        io.save_checkpoint({"global_step": 1, "w": torch.ones(64)}, short_tmp / "a.ckpt")
        assert _ckpt_threads()  # the torch file's writer, until the plugin goes
    else:
        wrapper = AsyncCheckpointIO(io)
        wrapper.save_checkpoint({"global_step": 1, "w": torch.ones(64)}, short_tmp / "a.ckpt")
        wrapper.teardown()  # Lightning's: it waits for its own thread, and does not call the plugin's teardown
        del wrapper
        assert _ckpt_threads() == []  # a save on the wrapper's thread finished its file and tore down
    assert all(t.daemon for t in _ckpt_threads())  # none keeps the process alive
    del io
    gc.collect()  # the plugin is gone: its files are written and its Checkpointer closed
    assert _ckpt_threads() == []
    assert torch.equal(torch.load(short_tmp / "a.ckpt")["w"], torch.ones(64))


def test_no_ckpt_thread_outlives_a_fit_that_raises(daemon, short_tmp):
    trainer = make_trainer(JOB, str(short_tmp), max_epochs=1, address=daemon.address, every_n_steps=1)
    with pytest.raises(RuntimeError, match="training failed"):
        trainer.fit(_Fails(), data())
    assert _ckpt_threads() == []  # Lightning's teardown after the failure closed the plugin
    assert torch.load(short_tmp / "last.ckpt")["global_step"] == 2  # the files of the saves before it are written
