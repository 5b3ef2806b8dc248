"""A job's history against a real ckptd: no silent rewind, rollback on purpose, superseded steps, mixed lines."""

from __future__ import annotations

import datetime
import json

import ckpt
import pytest
import torch
from ckpt_core.errors import InvalidArgument, SaveFailed
from conftest import eventually

pytestmark = pytest.mark.e2e


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def _ls(daemon, job: str) -> dict[int, dict]:
    listed = daemon.cli("ls", "--job", job, "--json")
    assert listed.returncode == 0, listed.stderr
    return {s["step"]: s for s in json.loads(listed.stdout)}


def _ranks(daemon, job: str, world_size: int) -> list[ckpt.Checkpointer]:
    return [
        ckpt.Checkpointer(job=job, rank=r, world_size=world_size, address=daemon.address) for r in range(world_size)
    ]


def _save_all(ranks: list[ckpt.Checkpointer], step: int) -> None:
    handles = [c.save_async(_state(float(step)), step=step) for c in ranks]
    for h in handles:
        h.wait("nvme", timeout=60)


def test_a_new_run_under_a_used_job_name_is_refused_and_the_old_steps_stay(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()
    with ckpt.Checkpointer(job="rewind", address=daemon.address) as c:
        for s in (100, 200, 300, 400):
            c.save_async(_state(float(s)), step=s).wait("nvme", timeout=60)
        with pytest.raises(InvalidArgument, match=r"rewind step 10 is older than step 400, which this rank"):
            c.save_async(_state(10.0), step=10)
    with ckpt.Checkpointer(job="rewind", address=daemon.address) as fresh:  # a new run: the snippet of issue 24
        with pytest.raises(InvalidArgument) as refused:
            fresh.save_async(_state(10.0), step=10)
        message = str(refused.value)
        saved_at = _ls(daemon, "rewind")[400]["committed_at"]
        assert f"step 400, the job's newest complete step, saved {saved_at}" in message
        for way_forward in ("a new job name", "ckptd gc --job rewind --all", "Checkpointer.load(step=N)"):
            assert way_forward in message
        again = fresh.save_async(_state(400.0), step=400)  # the head itself, saved again: complete, never rewritten
        assert again.skipped and "already complete" in again.reason
        assert fresh.latest_step() == 400
        assert fresh.load()["w"][0].item() == 400.0
    assert sorted(_ls(daemon, "rewind")) == [100, 200, 300, 400]
    assert not any(s["superseded"] for s in _ls(daemon, "rewind").values())


def test_a_rollback_at_two_ranks_starts_a_new_line_and_supersedes_the_old(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()
    ranks = _ranks(daemon, "spike", 2)
    for s in (100, 200, 300, 400):
        _save_all(ranks, s)
    for c in ranks:  # the loss spike: every rank goes back to 300
        assert c.load(step=300)["w"][0].item() == 300.0
    for s in (310, 320):
        _save_all(ranks, s)
    for c in ranks:
        c.close()
    newest = json.loads(daemon.cli("status", "--json").stdout)["newest_complete"]["spike"]
    assert newest["nvme"]["step"] == 320 and newest["memory"]["step"] == 320  # the head, not the old line's 400
    restarted = _ranks(daemon, "spike", 2)
    assert [c.latest_step() for c in restarted] == [320, 320]
    assert [c.load()["w"][0].item() for c in restarted] == [320.0, 320.0]
    listed = _ls(daemon, "spike")
    assert {s: v["superseded"] for s, v in listed.items()} == {
        100: False, 200: False, 300: False, 310: False, 320: False, 400: True
    }  # fmt: skip
    text = daemon.cli("ls", "--job", "spike")
    assert text.returncode == 0, text.stderr
    row = next(line for line in text.stdout.splitlines() if line.split()[1:2] == ["400"])
    assert row.endswith("superseded")
    committed = datetime.datetime.fromisoformat(listed[320]["committed_at"])
    assert abs((datetime.datetime.now(datetime.UTC) - committed).total_seconds()) < 120
    assert committed.strftime("%Y-%m-%d %H:%M:%S") in next(line for line in text.stdout.splitlines() if " 320 " in line)
    # The restarted ranks continue the new line; a save below its head is refused as any rewind is.
    with pytest.raises(InvalidArgument, match="older than step 320"):
        restarted[0].save_async(_state(315.0), step=315)
    _save_all(restarted, 330)
    assert restarted[1].latest_step() == 330
    for c in restarted:
        c.close()
    with ckpt.Checkpointer(job="spike", rank=0, world_size=2, address=daemon.address) as reader:
        assert reader.load(step=400)["w"][0].item() == 400.0  # named, a superseded step still loads


def test_a_rollback_saves_a_superseded_step_number_again(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()
    with ckpt.Checkpointer(job="again", address=daemon.address) as c:
        for s in (100, 200, 300, 400):
            c.save_async(_state(float(s)), step=s).wait("nvme", timeout=60)
        c.load(step=300)
        c.save_async(_state(-400.0), step=400).wait("nvme", timeout=60)  # the cadence of the old line, on the new one
        assert c.latest_step() == 400
        assert c.load()["w"][0].item() == -400.0
        assert c.load(step=400)["w"][0].item() == -400.0
    listed = _ls(daemon, "again")
    assert sorted(listed) == [100, 200, 300, 400]
    assert not any(s["superseded"] for s in listed.values())


def test_ranks_that_continue_different_lines_never_complete_the_step(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()
    ranks = _ranks(daemon, "mixed", 2)
    for s in (100, 200, 300):
        _save_all(ranks, s)
    ranks[0].load(step=200)  # rank 0 rolls back, rank 1 does not
    handles = [c.save_async(_state(310.0), step=310) for c in ranks]
    with pytest.raises(SaveFailed, match="every rank must load the same step"):  # the rank that came last, at least
        handles[1].wait("nvme", timeout=60)
    assert 310 not in _ls(daemon, "mixed")
    status = json.loads(daemon.cli("status", "--json").stdout)
    assert any("continue different lines" in e["error"] for e in status["recent_errors"])
    assert ranks[1].latest_step() == 300
    for c in ranks:
        c.close()


@pytest.mark.s3
def test_a_rollback_saves_a_superseded_step_again_in_the_object_store_too(make_daemon, s3_server, short_tmp):
    bucket = s3_server.new_bucket()
    daemon = make_daemon(s3_server.toml(f"s3://{bucket}/ckpts") + "[retention]\nnvme = 0\n").start()
    with ckpt.Checkpointer(job="cloud", address=daemon.address) as c:
        for s in (1, 2):
            c.save_async(_state(float(s)), step=s).wait("object", timeout=60)
        c.load(step=1)
        c.save_async(_state(-2.0), step=2).wait("object", timeout=60)  # the new line's step 2, uploaded
    out = daemon.cli("restore", "--job", "cloud", "--step", "2", "--from", "object", "--to", str(short_tmp / "r"))
    assert out.returncode == 0, out.stderr
    assert ckpt.load_local(short_tmp / "r" / "cloud" / "2")["w"][0].item() == -2.0
    assert "superseded by a rollback's line that saves it again" in daemon.log()


def test_retention_removes_the_superseded_step_before_any_step_of_the_line(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 3\n").start()
    ranks = _ranks(daemon, "order", 2)
    for s in (100, 200, 300, 400):
        _save_all(ranks, s)
    for c in ranks:
        c.load(step=300)
    _save_all(ranks, 310)

    def on_nvme() -> list[int]:
        return sorted(s for s, v in _ls(daemon, "order").items() if "nvme" in v["tiers"])

    # The line is 100, 200, 300, 310: the newest 3 of it stay; 400, newer by number, goes first, and 100.
    eventually(lambda: on_nvme() == [200, 300, 310], what="the superseded step and the line's oldest removed")
    _save_all(ranks, 320)
    eventually(lambda: on_nvme() == [300, 310, 320], what="the line's oldest removed")
    for c in ranks:
        c.close()


def test_a_rollback_retires_the_superseded_replicas_on_other_nodes(make_cluster):
    # Both other nodes keep a replica of every step; after a rollback, the new line's step 400 replaces the old
    # line's on each of them (their replica stores and what they list and load), and the old line's step 500,
    # which the new line has not saved again, is superseded there too.
    a, b, c = (d.start() for d in make_cluster(3, replicas=2, extra_toml="[retention]\nnvme = 0\npeer = 0\n"))
    with ckpt.Checkpointer(job="lines", rank=0, world_size=1, address=a.address) as r:
        for s in (100, 200, 300, 400, 500):
            r.save_async(_state(float(s)), step=s).wait("peer", timeout=60)
        r.load(step=300)
        r.save_async(_state(-400.0), step=400).wait("peer", timeout=60)
    for node in (b, c):
        replica = ckpt.load_local(node.root / ".peer" / "lines" / "400")
        assert replica["w"][0].item() == -400.0, f"{node.root} kept the superseded step 400"
        assert ckpt.load_local(node.root / ".peer" / "lines" / "500")["w"][0].item() == 500.0
        listed = _ls(node, "lines")
        assert not listed[400]["superseded"] and listed[500]["superseded"], listed
        with ckpt.Checkpointer(job="lines", rank=0, world_size=1, address=node.address) as other:
            assert other.latest_step() == 400
            assert other.load()["w"][0].item() == -400.0
            assert other.load(step=400)["w"][0].item() == -400.0


def test_a_node_down_during_a_rollback_gets_the_new_lines_replica_when_it_returns(make_cluster):
    # b is down while the new line saves step 400 again: it still holds the old line's 400 when it returns. It never
    # loads that as the job's latest or as step 400, and the new line's replica replaces it once sent there.
    a, b, c = make_cluster(3, replicas=2, extra_toml="[retention]\nnvme = 0\npeer = 0\n")
    for node in (a, b, c):
        node.start()
    with ckpt.Checkpointer(job="lines", rank=0, world_size=1, address=a.address) as r:
        for s in (100, 200, 300, 400):
            r.save_async(_state(float(s)), step=s).wait("peer", timeout=60)
        b.kill()
        r.load(step=300)
        r.save_async(_state(-400.0), step=400).wait("nvme", timeout=60)
        eventually(lambda: (c.root / ".peer" / "lines" / "400").exists() and _replica(c, 400) == -400.0, what="c's")
        b.start()
        with ckpt.Checkpointer(job="lines", rank=0, world_size=1, address=b.address) as other:
            assert other.load(step=400)["w"][0].item() == -400.0
            assert other.load()["w"][0].item() == -400.0
        eventually(lambda: _replica(b, 400) == -400.0, timeout_s=120, what="the new line's replica on b")
        assert not _ls(b, "lines")[400]["superseded"]


def _replica(node, step: int) -> float | None:
    try:
        return ckpt.load_local(node.root / ".peer" / "lines" / str(step))["w"][0].item()
    except Exception:
        return None
