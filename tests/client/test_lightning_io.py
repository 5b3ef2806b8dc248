"""CkptdCheckpointIO without a daemon: the pointer format, its errors, and what is refused before ckptd is asked."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import ckpt
import fsspec
import numpy as np
import pytest
import torch
from ckpt.lightning import MAX_POINTER_BYTES, CkptdCheckpointIO, Pointer, fingerprint, read_pointer, write_pointer
from lightning.fabric.plugins import TorchCheckpointIO
from states import assert_same

POINTER = Pointer(job="run-7", step=120, global_step=120, address="unix:/run/ckptd/ckptd.sock")


def test_importing_ckpt_does_not_import_lightning():
    code = "import sys, ckpt; ckpt.Checkpointer; import ckpt.dcp; assert 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_pointer_is_one_small_json_object_written_whole(tmp_path):
    path = tmp_path / "sub" / "last.ckpt"
    write_pointer(str(path), POINTER)
    assert json.loads(path.read_text()) == {
        "format": "ckptd-lightning-pointer",
        "version": 1,
        "job": "run-7",
        "step": 120,
        "global_step": 120,
        "address": "unix:/run/ckptd/ckptd.sock",
    }
    assert read_pointer(str(path)) == POINTER
    write_pointer(str(path), Pointer("run-7", 130, 125, POINTER.address))  # over the older one
    assert read_pointer(str(path)).step == 130  # type: ignore[union-attr]
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no .partial left


def test_a_path_with_nothing_there_is_named_as_lightning_names_it(tmp_path):
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(FileNotFoundError) as lightnings:
        TorchCheckpointIO().load_checkpoint(missing)
    with pytest.raises(FileNotFoundError) as ours:
        CkptdCheckpointIO(job="j").load_checkpoint(missing)
    assert str(ours.value) == str(lightnings.value) == f"Checkpoint file not found: {missing}"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{not json", "is not a ckptd pointer"),
        (b'{"job": "j", "step": 1}', 'not a ckptd pointer \\(no "format"'),
        (
            json.dumps({"format": "ckptd-lightning-pointer", "version": 2}).encode(),
            "of version 2; this ckpt reads version 1",
        ),
        (b'{"format": "ckptd-lightning-pointer", "version": 1, "job": "j", "step": 1}', "broken.*KeyError"),
        (POINTER.to_json().replace(b'"step": 120', b'"step": -1'), "broken.*invalid step -1"),
        (POINTER.to_json().replace(b'"run-7"', b'"../x"'), "broken.*invalid job name"),
        (POINTER.to_json().replace(b'"unix:/run/ckptd/ckptd.sock"', b"7"), "broken.*address 7 is not a string"),
        (b"{" + b" " * MAX_POINTER_BYTES + b"}", f"larger than {MAX_POINTER_BYTES} bytes"),
    ],
    ids=["not-json", "other-json", "newer-version", "missing-field", "bad-step", "bad-job", "bad-address", "too-big"],
)
def test_a_file_that_is_not_a_good_pointer_is_named(tmp_path, content, error):
    path = tmp_path / "x.ckpt"
    path.write_bytes(content)
    with pytest.raises(ckpt.InvalidArgument, match=f"{path} .*{error}"):
        CkptdCheckpointIO(job="j").load_checkpoint(path)


def test_a_job_name_is_taken_from_the_argument_or_ckpt_job_and_needed_to_save(monkeypatch, tmp_path):
    monkeypatch.delenv("CKPT_JOB", raising=False)
    assert CkptdCheckpointIO().job is None  # it may load: a pointer names its job
    with pytest.raises(ckpt.InvalidArgument, match=r"needs a ckptd job name to save: pass job=\.\.\. or set CKPT_JOB"):
        CkptdCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    monkeypatch.setenv("CKPT_JOB", "from-env")
    assert CkptdCheckpointIO().job == "from-env"
    assert CkptdCheckpointIO(job="given").job == "given"
    with pytest.raises(ckpt.InvalidArgument, match="invalid job name"):
        CkptdCheckpointIO(job="a/b")


def test_teardown_waits_for_memory_or_nvme_only():
    with pytest.raises(ckpt.InvalidArgument, match="teardown_tier must be one of memory, nvme, not 'object'"):
        CkptdCheckpointIO(job="j", teardown_tier="object")
    CkptdCheckpointIO(job="j", teardown_tier="memory").teardown()  # nothing saved: nothing to wait for


def test_storage_options_are_accepted_and_ignored_with_a_word(tmp_path, caplog):
    io = CkptdCheckpointIO(job="j")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "x.ckpt", storage_options={"a": 1})  # not a Trainer's
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "y.ckpt", storage_options={"a": 1})
    assert torch.equal(torch.load(tmp_path / "x.ckpt")["w"], torch.ones(2))
    assert [r.getMessage() for r in caplog.records if "storage_options" in r.getMessage()] == [
        "ckpt: storage_options {'a': 1} ignored: where ckptd keeps checkpoints is the daemon's configuration"
    ]  # once


def test_a_dict_without_global_step_goes_through_torch_save_as_ddp_spawns_weights_do(tmp_path):
    io = CkptdCheckpointIO(job="j", address=str(tmp_path / "no-daemon.sock"))  # never asked
    weights = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.zeros(3)}
    path = tmp_path / "tmp" / ".temp.ckpt"
    io.save_checkpoint(weights, path)
    assert read_pointer(str(path)) is None  # a torch file
    assert_same(io.load_checkpoint(path), weights)
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # gone already: nothing to do


def test_a_fingerprint_matches_the_same_tensors_unchanged_and_nothing_else():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()

    def checkpoint(**more):
        return {
            "global_step": 1,
            "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()],
            **more,
        }

    first = fingerprint(checkpoint(note="a"))
    assert first is not None and fingerprint(checkpoint(note="b")) == first  # fresh views; values other than tensors
    optimizer.step()  # in place: the version counters move
    assert fingerprint(checkpoint()) != first
    again = fingerprint(checkpoint())
    assert fingerprint(checkpoint(extra=torch.zeros(1))) != again
    assert fingerprint(checkpoint(extra=np.zeros(1))) is None  # numpy arrays keep no version counter
    with torch.inference_mode():
        assert fingerprint(checkpoint(extra=torch.zeros(1))) is None


def test_pointers_go_wherever_fsspec_reaches_as_a_remote_dirpath_does():
    fs = fsspec.filesystem("memory")
    url = f"memory://ckpt-{uuid.uuid4().hex}/checkpoints/last.ckpt"
    try:
        write_pointer(url, POINTER)
        assert read_pointer(url) == POINTER
        CkptdCheckpointIO(job="j").remove_checkpoint(url)
        assert not fs.exists(url)
    finally:
        fs.rm(url.rsplit("/", 2)[0], recursive=True)


def test_a_torch_file_carries_its_pointer_and_is_read_without_its_tensors(tmp_path):
    from collections import OrderedDict

    from ckpt.lightning_files import POINTER_KEY

    checkpoint = {"global_step": 120, "state_dict": OrderedDict(w=torch.arange(4.0)), "hyper_parameters": {"lr": 0.1}}
    torch.save({**checkpoint, POINTER_KEY: POINTER.to_json().decode()}, tmp_path / "last.ckpt")
    torch.save(checkpoint, tmp_path / "plain.ckpt")
    assert read_pointer(str(tmp_path / "last.ckpt")) == POINTER
    assert read_pointer(str(tmp_path / "plain.ckpt")) is None  # a torch checkpoint of another kind
    # weights_only reads the file itself (no ckptd needed), without the pointer's key
    loaded = CkptdCheckpointIO(job="j").load_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert sorted(loaded) == sorted(checkpoint) and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
