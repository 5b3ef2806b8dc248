"""Checkpointer arguments are checked before anything is saved."""

from __future__ import annotations

import ckpt
import pytest
from ckpt_core.wire.v1 import ckptd_pb2 as pb


def test_job_rank_and_world_size_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CKPT_JOB", "envjob")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with ckpt.Checkpointer(address="/nonexistent.sock") as c:
        assert (c.job, c.rank, c.world_size) == ("envjob", 3, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"job": "x", "colour": "blue"}, "unknown Checkpointer options"),
        ({"job": "x", "copy_threads": 0}, "copy_threads"),
        ({"job": "x", "rank": 2, "world_size": 2}, "invalid rank"),
        ({"job": "x/y"}, "invalid job name"),
        ({"job": "x", "keep": -1}, "keep must be None"),
        ({"job": "x", "keep_every": "1000"}, "keep_every must be None"),
        ({"job": "x", "keep": True}, "keep must be None"),
        ({"job": "x", "keep": 2**31}, "keep must be None"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ckpt.InvalidArgument, match=message):
        ckpt.Checkpointer(address="/nonexistent.sock", **kwargs)


@pytest.mark.parametrize(
    "kwargs, sent",
    [
        ({}, {}),  # sent empty: the daemon's config, also over what an earlier Checkpointer of the job set
        ({"keep": 0}, {"keep": 0}),
        ({"keep_every": 1000}, {"keep_every": 1000}),
        ({"keep": 3, "keep_every": 5}, {"keep": 3, "keep_every": 5}),
    ],
)
def test_the_jobs_own_retention_carries_only_what_was_given(kwargs, sent, monkeypatch):
    asked = {}

    def answer(method, request, timeout_s=60.0):  # the daemon, as far as a skipped save goes
        asked[method] = request
        return pb.ListReply() if method == "List" else pb.ReserveReply(skipped=True, reason="no room")

    with ckpt.Checkpointer(job="x", address="/nonexistent.sock", **kwargs) as c:
        monkeypatch.setattr(c.daemon, "call", answer)
        assert c.save_async({}).skipped
    assert asked["Reserve"].HasField("retention")
    given = asked["Reserve"].retention  # proto3 optional: an unset field is not a 0
    assert {f.name: v for f, v in given.ListFields()} == sent


def test_a_bad_rank_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ckpt.InvalidArgument, match="RANK"):
        ckpt.Checkpointer(job="x", address="/nonexistent.sock")


def test_a_closed_checkpointer_refuses_to_save():
    c = ckpt.Checkpointer(job="x", address="/nonexistent.sock")
    c.close()
    c.close()  # closing twice is fine
    with pytest.raises(ckpt.CheckpointError, match="closed"):
        c.save_async({})


def test_the_run_id_comes_from_torchrun_or_the_caller(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with ckpt.Checkpointer(job="x", address="/nonexistent.sock") as c:
        assert c.run_id == ""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    with ckpt.Checkpointer(job="x", address="/nonexistent.sock") as c:
        assert c.run_id == "torchelastic:job42:3"
    with ckpt.Checkpointer(job="x", address="/nonexistent.sock", run_id="slurm-77") as c:
        assert c.run_id == "slurm-77"


def test_every_name_the_readme_documents_is_exported():
    import re
    from pathlib import Path

    import ckpt

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    errors = readme[readme.index("Errors are subclasses of") :].split("\n- ", 1)[0]
    names = set(re.findall(r"`(?:ckpt\.)?([A-Z][A-Za-z]+)`", errors)) | set(re.findall(r"`ckpt\.([a-z_]+)\(", readme))
    assert {"ReservationLost", "SaveSkipped", "load_local", "save_async"} <= names
    assert all(hasattr(ckpt, name) and name in ckpt.__all__ for name in names), names - set(ckpt.__all__)
