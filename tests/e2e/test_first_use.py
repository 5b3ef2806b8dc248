"""What a new user meets first, against a real ckptd: bounds that cannot lock a job, messages that name the way out."""

from __future__ import annotations

import socket
import subprocess
import sys

import ckpt
import pytest
import torch
from ckpt_core.errors import DaemonUnavailable, InvalidArgument, NotFound

pytestmark = pytest.mark.e2e


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def test_a_named_step_cannot_lock_the_job_and_the_top_names_the_way_out(daemon):
    with ckpt.Checkpointer(job="far", address=daemon.address) as c:
        with pytest.raises(InvalidArgument, match=r"far step 2305843009213693952 is above 2\*\*61-1"):
            c.save_async(_state(0.0), step=2**61)
        c.save_async(_state(1.0), step=2**61 - 1).wait(timeout=60)
        h = c.save_async(_state(2.0))  # step=None still has room after the highest named step
        h.wait(timeout=60)
        assert h.step == 2**61
    with ckpt.Checkpointer(job="top", address=daemon.address) as c:
        c.save_async(_state(1.0), step=2**61 - 1).wait(timeout=60)
        c._saves._last_step = 2**62 - 1  # the state of a job after 2**61 saves, which no test can make
        with pytest.raises(InvalidArgument, match=r"top has no step after 4611686018427387903.*new job name.*ckptd rm"):
            c.save_async(_state(2.0))


def test_no_job_asks_for_one(monkeypatch):
    monkeypatch.delenv("CKPT_JOB", raising=False)
    with pytest.raises(InvalidArgument, match=r"needs a job name: pass Checkpointer\(job=\.\.\.\) or set CKPT_JOB"):
        ckpt.Checkpointer(address="/nonexistent.sock")


def test_an_unreachable_daemon_does_not_suggest_the_variable_already_set(short_tmp, monkeypatch):
    monkeypatch.setenv("CKPTD_ADDRESS", str(short_tmp / "none.sock"))
    with ckpt.Checkpointer(job="x") as c, pytest.raises(DaemonUnavailable) as refused:
        c.latest_step()
    assert "check CKPTD_ADDRESS, which named this address" in str(refused.value)
    assert "set CKPTD_ADDRESS" not in str(refused.value)


def test_done_on_a_tier_this_node_lacks_is_false_and_wait_says_why(daemon):
    with ckpt.Checkpointer(job="alone", address=daemon.address) as c:
        h = c.save_async(_state(1.0), step=1)
        h.wait("nvme", timeout=60)
        assert h.done("peer") is False
        assert h.done("object") is False
        with pytest.raises(ckpt.SaveFailed, match="tier peer is not configured"):
            h.wait("peer", timeout=5)


def test_one_rank_and_any_tier_read_right(daemon):
    with ckpt.Checkpointer(job="one", address=daemon.address) as c:
        c.save_async(_state(1.0), step=1).wait(timeout=60)
    two = ckpt.Checkpointer(job="one", rank=0, world_size=2, address=daemon.address)
    with two, pytest.raises(InvalidArgument, match=r"saved by 1 rank, and this Checkpointer has world_size 2"):
        two.load(1)
    second = ckpt.Checkpointer(job="one", rank=1, world_size=2, address=daemon.address)
    with second, pytest.raises(NotFound, match=r"has no rank 1: it was saved by 1 rank \(world_size 1\)"):
        second.load(1)
    with ckpt.Checkpointer(job="one", address=daemon.address) as c, pytest.raises(NotFound, match="any tier"):
        c.load(9)


def test_inspect_reads_the_latest_step_by_default(daemon):
    with ckpt.Checkpointer(job="look", address=daemon.address) as c:
        for step in (3, 7):
            c.save_async({"w": torch.zeros(2, 3)}, step=step).wait(timeout=60)
    for args in ((), ("--step", "latest")):
        out = daemon.cli("inspect", "--job", "look", *args)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("look step 7: 1 rank, ")
    out = daemon.cli("inspect", "--job", "look", "--step", "soon")
    assert out.returncode == 2 and "a number or latest" in out.stderr


def test_a_tier_off_in_the_config_names_what_to_give(daemon):
    with ckpt.Checkpointer(job="v", address=daemon.address) as c:
        c.save_async(_state(1.0), step=1).wait(timeout=60)
    out = daemon.cli("verify", "--job", "v", "--tier", "object")
    assert out.returncode == 1
    assert "tier object is off in the config this command read (no [object] url)" in out.stderr
    assert "--tier s3://bucket/prefix" in out.stderr


def test_a_root_that_is_a_file_says_so_and_a_missing_one_is_created_naming_it(make_daemon, short_tmp):
    (short_tmp / "a-file").write_text("not a directory")
    taken = make_daemon(root=short_tmp / "a-file")
    r = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--config", str(taken.config_path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert f"{short_tmp / 'a-file'} is not a directory" in r.stderr and "File exists" not in r.stderr
    fresh = make_daemon(root=short_tmp / "not" / "yet").start()
    assert f"node.root {short_tmp / 'not' / 'yet'} did not exist: created it" in fresh.log()
    assert "that disk is not mounted" in fresh.log()


def test_a_port_in_use_stops_the_daemon_with_its_message_alone(make_daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra, listen in (
            (f'[metrics]\nlisten = "127.0.0.1:{port}"\n', ""),
            ("[peer]\ninsecure = true\n", f"127.0.0.1:{port}"),
        ):
            node = make_daemon(extra, listen=listen)
            r = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--config", str(node.config_path)],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
            assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr
            assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
            assert not node.socket.exists()


def test_import_of_a_class_from_the_saving_script_says_what_to_do(daemon, short_tmp):
    saved = short_tmp / "main-class.pt"
    code = f"import torch\nclass Box:\n    pass\ntorch.save({{'box': Box()}}, {str(saved)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    run = daemon.cli("import", "--job", "boxed", "--step", "1", "--torch", str(saved), "--trusted")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "a class defined in the script that saved it (__main__)" in run.stderr
    assert "Re-save plain values (model.state_dict(), not the model)" in run.stderr


@pytest.mark.s3
def test_a_missing_bucket_stops_the_start_naming_it(make_daemon, s3_server):
    node = make_daemon(s3_server.toml("s3://no-such-bucket-here/ckpts"))
    r = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--config", str(node.config_path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "object.url: the bucket no-such-bucket-here does not exist" in r.stderr
    assert "ckptd never creates buckets" in r.stderr and "Traceback" not in r.stderr
