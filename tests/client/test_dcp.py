"""ckpt.dcp without a daemon: checkpoint ids, the step every rank saves at, staging hand-offs and bad arguments."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from multiprocessing.reduction import ForkingPickler

import ckpt
import ckpt.dcp
import pytest
import torch
from ckpt.dcp_writer import checkpoint_step
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

NO_DAEMON = "/nonexistent/ckptd.sock"  # nothing here connects: a Checkpointer dials only on its first call


def writer(**kwargs) -> ckpt.dcp.Writer:
    return ckpt.dcp.Writer(job="j", rank=0, world_size=1, address=NO_DAEMON, **kwargs)


@pytest.mark.parametrize("checkpoint_id, step", [(0, 0), (12, 12), ("12", 12), ("007", 7)])
def test_a_checkpoint_id_names_a_step(checkpoint_id, step):
    assert checkpoint_step(checkpoint_id) == step
    assert ckpt.dcp.Writer.validate_checkpoint_id(checkpoint_id)


@pytest.mark.parametrize("checkpoint_id", [-1, True, 1.0, "", "1.5", "/ckpt/j/3", "٣", 2**62])
def test_anything_else_names_no_step(checkpoint_id):
    assert checkpoint_step(checkpoint_id) is None
    assert not ckpt.dcp.Writer.validate_checkpoint_id(checkpoint_id)


def test_the_writer_is_its_own_stager_and_both_are_dcp_storage():
    with writer() as w:
        assert isinstance(w, StorageWriter) and isinstance(w, AsyncStager)
        assert w.should_synchronize_after_execute
    assert issubclass(ckpt.dcp.Reader, StorageReader)


def test_a_bad_checkpoint_id_is_named():
    with writer() as w, pytest.raises(ckpt.InvalidArgument, match="checkpoint_id 'latest' is not a step"):
        w.reset("latest")


def test_the_coordinator_gives_every_rank_the_step_they_were_given():
    with writer() as w:
        plans = w.prepare_global_plan([SavePlan([], storage_data=4), SavePlan([], storage_data=None)])
        assert [p.storage_data for p in plans] == [4, 4]
        with pytest.raises(ckpt.InvalidArgument, match=r"different steps \[4, 5\]"):
            w.prepare_global_plan([SavePlan([], storage_data=4), SavePlan([], storage_data=5)])


def test_checkpoint_id_then_step_then_none_pick_the_step_of_each_save():
    with writer(step=9) as w:
        w.reset("3")
        w.set_up_storage_writer(True)
        assert w.prepare_local_plan(SavePlan([])).storage_data == 3  # checkpoint_id first, for one save
        w.set_up_storage_writer(True)
        assert w.prepare_local_plan(SavePlan([])).storage_data == 9  # then the Writer's step


def test_a_staged_save_that_cannot_be_set_up_fails_at_once_with_the_reason():
    with writer() as w:
        state = {"w": torch.ones(2)}
        assert w.stage(state) is state  # nothing copied yet: the step is not known
        with pytest.raises(ckpt.InvalidArgument, match="'x' is not a step"):
            w.reset("x")  # dcp.async_save's upload thread, before it sets the save up
        with pytest.raises(ckpt.InvalidArgument, match="'x' is not a step"):
            w.synchronize_staging()  # the training thread hears why, with no wait
        w.synchronize_staging()  # nothing staged any more


def test_the_writer_travels_to_dcps_process_with_its_settings():
    with writer(step=4) as w:
        far = pickle.loads(pickle.dumps(w))  # what DCP's process executor does with it, nothing staged
        with far:
            assert repr(far) == repr(w)
            far.set_up_storage_writer(True)
            assert far.prepare_local_plan(SavePlan([])).storage_data == 4


def test_a_save_staged_for_dcps_process_holds_the_training_thread_until_that_process_says():
    with writer() as w:
        w.stage({"w": torch.ones(2)})
        far = pickle.loads(ForkingPickler.dumps(w))  # DCP's pickler carries the channel
        with far, pytest.raises(ckpt.InvalidArgument, match="'x' is not a step"):
            far.reset("x")  # in DCP's process: the save cannot be set up
        with pytest.raises(ckpt.CheckpointError, match=r"could not copy the state: InvalidArgument: .*'x' is not"):
            w.synchronize_staging()  # the training thread hears why at once
        w.synchronize_staging()  # nothing staged any more


def test_a_save_that_fails_in_dcps_process_before_this_ranks_copy_frees_the_training_thread():
    with writer() as w:
        w.stage({"w": torch.ones(2)})
        sent: list[bytes] = []
        upload = threading.Thread(target=lambda: sent.append(ForkingPickler.dumps(w)))  # DCP's upload thread
        upload.start()
        upload.join()  # it ended: the save failed over there (another rank's plan) and never reached write_data
        with pickle.loads(sent[0]), pytest.raises(ckpt.CheckpointError, match="before this rank's copy"):
            w.synchronize_staging()


def test_the_reader_takes_a_job_or_a_path(tmp_path):
    with pytest.raises(ckpt.InvalidArgument, match="not both"):
        ckpt.dcp.Reader(job="j", path=tmp_path)
    with pytest.raises(ckpt.NotFound, match="not a directory"):
        ckpt.dcp.Reader(path=tmp_path / "missing").read_metadata()
    reader = ckpt.dcp.Reader(path=tmp_path)
    with pytest.raises(ckpt.InvalidArgument, match="names no step"):
        reader.reset("12")  # a step number needs a job to find it
    assert not ckpt.dcp.Reader.validate_checkpoint_id(tmp_path)  # no COMMIT.json: not a step directory


def test_importing_ckpt_does_not_import_dcp():
    code = "import sys, ckpt\nassert 'torch.distributed.checkpoint' not in sys.modules\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
