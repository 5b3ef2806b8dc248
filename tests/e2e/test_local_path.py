"""The local path end to end, with real ckptd processes: save, flush, crash, resume, load, restore, verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ckpt
import pytest
import torch
from ckpt.transport import DaemonClient
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import COMMIT_NAME, data_name
from states import Holder, Point, assert_same, every_kind_state

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("rank_worker.py")
TESTS = Path(__file__).resolve().parent.parent


def run_rank(daemon, job, rank, world_size, steps, *extra):
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "PYTHONPATH": str(TESTS)}
    args = [sys.executable, str(WORKER), "--address", daemon.address, "--job", job, "--steps", *map(str, steps), *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


def ls_json(daemon, *args):
    r = daemon.cli("ls", "--json", "--address", daemon.address, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_every_dtype_and_structure_round_trips_through_the_daemon(daemon):
    state = every_kind_state(seed=7)
    with ckpt.Checkpointer(job="kinds", address=daemon.address) as c:
        h = c.save_async(state, step=5)
        assert h.done("memory")
        h.wait("nvme", timeout=60)
        assert h.done("nvme")
        for tier in ("memory", "nvme", "auto"):
            assert_same(state, c.load(5, tier=tier))
        assert c.latest_step() == 5


@pytest.mark.parametrize("in_slot", [True, False], ids=["layout-in-slot", "layout-in-message"])
def test_the_layout_travels_in_the_slot_or_for_older_daemons_in_the_message(daemon, monkeypatch, in_slot):
    sent = []
    real_call = DaemonClient.call

    def call(self, method, request, timeout_s=60.0):
        if method == "Commit":
            sent.append((request.layout_size_bytes, len(request.layout_json)))
        reply = real_call(self, method, request, timeout_s)
        if method == "Reserve" and not in_slot:
            reply.layout_in_slot = False  # as a daemon of an older version answers
        return reply

    monkeypatch.setattr(DaemonClient, "call", call)
    state = every_kind_state(seed=11)
    with ckpt.Checkpointer(job=f"layout-{in_slot}", address=daemon.address) as c:
        c.save_async(state, step=1).wait("nvme", timeout=60)
        assert_same(state, c.load(1, tier="nvme"))
        assert_same(state, c.load(1, tier="memory"))
    (in_slot_bytes, in_message_bytes) = sent[0]
    assert (in_slot_bytes > 0, in_message_bytes > 0) == (in_slot, not in_slot)


def test_snapshot_is_taken_when_save_async_returns(daemon):
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "opt": [torch.ones(1000)]}
    expected = {"w": state["w"].clone(), "opt": [state["opt"][0].clone()]}
    with ckpt.Checkpointer(job="snap", address=daemon.address) as c:
        h = c.save_async(state, step=1)
        state["w"].mul_(-3)  # the caller changes and frees its tensors at once
        state["opt"][0].zero_()
        del state["opt"]
        h.wait("nvme", timeout=60)
        assert_same(expected, c.load(1, tier="memory"))
        assert_same(expected, c.load(1, tier="nvme"))


def test_default_step_is_one_past_the_latest(daemon):
    with ckpt.Checkpointer(job="auto-step", address=daemon.address) as c:
        assert c.latest_step() is None
        assert c.save_async({"x": torch.ones(1)}).step == 0
        assert c.save_async({"x": torch.ones(1)}).step == 1
        c.save_async({"x": torch.ones(1)}, step=10).wait()
        assert c.latest_step() == 10
    with ckpt.Checkpointer(job="auto-step", address=daemon.address) as c:
        assert c.save_async({"x": torch.ones(1)}).step == 11


def test_module_level_api_uses_the_environment(daemon, monkeypatch):
    monkeypatch.setenv("CKPT_JOB", "modjob")
    monkeypatch.setenv("CKPTD_ADDRESS", daemon.address)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ckpt.init()
    ckpt.save_async({"a": torch.arange(4)}, step=3).wait(timeout=60)
    assert ckpt.latest_step() == 3
    assert torch.equal(ckpt.load()["a"], torch.arange(4))


def test_multi_rank_step_completes_only_with_every_rank(daemon):
    r0 = run_rank(daemon, "multi", 0, 2, [1, 2])
    finish(r0)
    assert ls_json(daemon) == []  # rank 1 has saved nothing: no step is complete anywhere
    with ckpt.Checkpointer(job="multi", rank=0, world_size=2, address=daemon.address) as c:
        assert c.latest_step() is None
    r1 = run_rank(daemon, "multi", 1, 2, [1, 2])
    finish(r1)
    steps = ls_json(daemon, "--job", "multi")
    assert [(s["step"], s["world_size"], s["tiers"]) for s in steps] == [
        (1, 2, ["memory", "nvme"]),
        (2, 2, ["memory", "nvme"]),
    ]
    for rank in (0, 1):
        with ckpt.Checkpointer(job="multi", rank=rank, world_size=2, address=daemon.address) as c:
            assert_same(every_kind_state(seed=rank * 1000 + 2), c.load())


def test_a_step_saved_by_another_world_size_is_refused_naming_both(daemon):
    for rank in (0, 1):
        finish(run_rank(daemon, "resized", rank, 2, [1]))
    for rank, world_size, step in ((0, 1, None), (1, 3, 1)):
        c = ckpt.Checkpointer(job="resized", rank=rank, world_size=world_size, address=daemon.address)
        with c, pytest.raises(InvalidArgument, match=rf"saved by 2 ranks.*world_size {world_size}"):
            c.load(step=step)


def test_ranks_in_parallel_and_jobs_side_by_side(daemon):
    procs = [run_rank(daemon, job, r, 2, [1, 2, 3]) for job in ("a", "b") for r in range(2)]
    for p in procs:
        finish(p)
    steps = ls_json(daemon)
    assert {(s["job"], s["step"]) for s in steps if "nvme" in s["tiers"]} == {
        (j, s) for j in ("a", "b") for s in (1, 2, 3)
    }


def test_client_killed_right_after_save_async_loses_nothing(daemon):
    proc = run_rank(daemon, "orphan", 0, 1, [4], "--die-after-save", "--size-mib", "64")
    out, _ = proc.communicate(timeout=120)
    assert "saved" in out and proc.returncode == -9
    with ckpt.Checkpointer(job="orphan", address=daemon.address) as c:
        h = ckpt.SaveHandle(c, 4, False, 0.0, "")
        h.wait("nvme", timeout=120)
        expected = every_kind_state(seed=4)
        for tier in ("memory", "nvme"):
            state = c.load(4, tier=tier)
            big = state.pop("big")
            assert big.numel() == 64 << 18
            assert_same(expected, state)


def test_daemon_killed_during_flush_finishes_on_restart(daemon):
    state = {"big": torch.randn(256 << 20 >> 2), "small": every_kind_state()}  # 256 MiB: a flush of many blocks
    with ckpt.Checkpointer(job="crash", address=daemon.address) as c:
        c.save_async(state, step=1).wait(timeout=60)
        c.save_async(state, step=2)
    step_dir = daemon.root / "crash" / "2"
    deadline = time.monotonic() + 60
    while not list(step_dir.glob(data_name(0) + ".*.partial")):  # the flush has begun writing: kill it there
        assert time.monotonic() < deadline, "the flush never started"
    daemon.kill()
    assert not (step_dir / COMMIT_NAME).exists()
    daemon.start()
    with ckpt.Checkpointer(job="crash", address=daemon.address) as c:
        h = ckpt.SaveHandle(c, 2, False, 0.0, "")
        h.wait("nvme", timeout=120)
        assert c.latest_step() == 2
        assert_same(state, c.load(2, tier="nvme"))
        assert_same(state, c.load(1, tier="nvme"))
    assert not list(step_dir.glob("*.partial"))
    assert "resuming flush of rank 0/1 shard of crash step 2" in daemon.log()


def test_partial_step_left_by_a_crash_is_never_listed_then_removed(daemon):
    with ckpt.Checkpointer(job="part", rank=0, world_size=2, address=daemon.address) as c:
        c.save_async({"x": torch.ones(3)}, step=1).wait(timeout=60)
    daemon.stop()
    # The other rank died before saving step 1; later a whole newer step completes.
    daemon.start()
    assert ls_json(daemon) == []
    for rank in range(2):
        with ckpt.Checkpointer(job="part", rank=rank, world_size=2, address=daemon.address) as c:
            c.save_async({"x": torch.ones(3) * rank}, step=2).wait(timeout=60)
    assert [s["step"] for s in ls_json(daemon)] == [2]
    r = daemon.cli("gc", "--dry-run", "--address", daemon.address)  # waits for the retention pass in flight
    assert r.returncode == 0 and "nothing to remove" in r.stdout
    assert "within its retention" in r.stdout and "ckptd status" in r.stdout  # why, and where to look
    assert not (daemon.root / "part" / "1").exists()


def test_flipped_byte_is_caught_by_verify_and_load_falls_back(daemon):
    state = {"w": torch.randn(3 << 20)}  # 12 MiB: three checksum chunks
    with ckpt.Checkpointer(job="flip", address=daemon.address) as c:
        c.save_async(state, step=1).wait(timeout=60)
    assert daemon.cli("verify", "--job", "flip").returncode == 0
    flip_byte(daemon.root / "flip" / "1" / data_name(0), (5 << 20) + 3)

    r = daemon.cli("verify", "--job", "flip", "--tier", "nvme")
    assert r.returncode == 1
    assert "BAD  nvme flip step 1 rank 0" in r.stdout and "chunk 1" in r.stdout
    with ckpt.Checkpointer(job="flip", address=daemon.address) as c:
        with pytest.raises(ckpt.CorruptCheckpoint, match=r"rank 0 shard of flip step 1 on tier nvme"):
            c.load(1, tier="nvme")
        assert_same(state, c.load(1))  # auto: the memory tier's copy is good

        held = next(daemon.staging_dir.glob("flip/rank-00000.slot-*.meta.json"))  # the slot holding step 1
        slot = held.with_name(held.name.removesuffix(".meta.json"))
        flip_byte(slot, 17)
        with pytest.raises(ckpt.CorruptCheckpoint, match="no tier holds a good copy"):
            c.load(1)
    r = daemon.cli("restore", "--job", "flip", "--to", str(daemon.base / "out"))
    assert r.returncode == 1 and "no good copy of rank 0" in r.stderr


def test_restore_to_a_directory_read_back_by_load_local(daemon):
    for rank in range(2):
        with ckpt.Checkpointer(job="rest", rank=rank, world_size=2, address=daemon.address) as c:
            c.save_async(every_kind_state(seed=rank), step=3).wait(timeout=60)
    for source in ("memory", "nvme", "auto"):
        out = daemon.base / f"out-{source}"
        r = daemon.cli("restore", "--job", "rest", "--step", "latest", "--from", source, "--to", str(out))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(out / "rest" / "3")
        for rank in range(2):
            assert_same(every_kind_state(seed=rank), ckpt.load_local(out / "rest" / "3", rank=rank))
    again = daemon.cli("restore", "--job", "rest", "--to", str(daemon.base / "out-nvme"))
    assert again.returncode == 1 and "already exists" in again.stderr

    cut_short = daemon.base / "out-nvme" / "rest" / "3"  # what a restore killed before its commit record leaves
    (cut_short / COMMIT_NAME).unlink()
    (cut_short / data_name(1)).write_bytes(b"half")
    r = daemon.cli("restore", "--job", "rest", "--to", str(daemon.base / "out-nvme"))
    assert r.returncode == 0 and "cut short" in r.stderr, r.stderr
    for rank in range(2):
        assert_same(every_kind_state(seed=rank), ckpt.load_local(cut_short, rank=rank))


def test_load_local_takes_a_restore_root_a_job_or_a_step(daemon):
    with ckpt.Checkpointer(job="paths", address=daemon.address) as c:
        for step in (4, 10):  # 10 after 4: the newest is found by number, not by name
            c.save_async({"step": step, "w": torch.arange(6) * step}, step=step).wait(timeout=60)
    out = daemon.base / "restored"
    for step in ("4", "10"):
        r = daemon.cli("restore", "--job", "paths", "--step", step, "--to", str(out))
        assert r.returncode == 0, r.stderr
    (out / "paths" / "11").mkdir()  # a step being restored (no commit record yet) is passed over
    assert ckpt.load_local(out)["step"] == 10  # the directory restore --to was given, as a user tries first
    assert ckpt.load_local(out / "paths")["step"] == 10
    assert ckpt.load_local(out / "paths" / "4")["step"] == 4
    assert ckpt.load_local(daemon.root)["step"] == 10  # an NVMe root of one job reads the same way

    (out / "other" / "1").mkdir(parents=True)
    with pytest.raises(ckpt.InvalidArgument, match=r"holds 2 jobs \(other, paths\): name one"):
        ckpt.load_local(out)
    with pytest.raises(ckpt.NotFound, match="none of its 1 step directories is complete"):
        ckpt.load_local(out / "other")
    with pytest.raises(ckpt.NotFound, match="holds no complete step"):
        ckpt.load_local(out / "paths" / "11")
    with pytest.raises(ckpt.NotFound, match="is not a directory"):
        ckpt.load_local(out / "nothing")


def test_restore_works_with_no_daemon_running(daemon):
    with ckpt.Checkpointer(job="cold", address=daemon.address) as c:
        c.save_async({"x": torch.arange(10)}, step=1).wait(timeout=60)
    assert daemon.stop() == 0
    r = daemon.cli("ls", "--json")  # with no daemon, ls reads this node's tiers itself
    assert r.returncode == 0 and "listing what this node's own tiers hold" in r.stderr
    [listed] = json.loads(r.stdout)
    committed_at = listed.pop("committed_at")
    assert listed == {
        "job": "cold", "step": 1, "world_size": 1, "size_bytes": 128, "tiers": ["memory", "nvme"], "superseded": False,
        "pinned": False
    }  # fmt: skip
    assert committed_at.endswith("Z") and committed_at[:4].isdigit()
    r = daemon.cli("restore", "--job", "cold", "--from", "nvme", "--to", str(daemon.base / "out"))
    assert r.returncode == 0, r.stderr
    assert torch.equal(ckpt.load_local(daemon.base / "out" / "cold" / "1")["x"], torch.arange(10))


def test_retention_keeps_the_newest_steps_and_gc_dry_run_reports(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 2\n").start()
    with ckpt.Checkpointer(job="ret", address=daemon.address) as c:
        for step in range(1, 6):
            c.save_async({"x": torch.full((10,), step)}, step=step).wait(timeout=60)
    # Each flush applies retention after waking its waiters; by the time step 5 is durable,
    # the passes after steps 3 and 4 are done.
    on_disk = sorted(int(p.name) for p in (daemon.root / "ret").iterdir() if p.name.isdigit())
    assert on_disk[:1] in ([3], [4]) and on_disk[-2:] == [4, 5]
    r = daemon.cli("gc", "--address", daemon.address)
    assert r.returncode == 0, r.stderr
    assert sorted(int(p.name) for p in (daemon.root / "ret").iterdir()) == [4, 5]
    assert sorted(s["step"] for s in ls_json(daemon) if "nvme" in s["tiers"]) == [4, 5]
    r = daemon.cli("gc", "--dry-run", "--address", daemon.address)
    assert r.returncode == 0 and "nothing to remove" in r.stdout


def test_gc_dry_run_shows_what_and_why_and_removes_nothing(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()
    with ckpt.Checkpointer(job="dry", address=daemon.address) as c:
        for step in (1, 2, 3):
            c.save_async({"x": torch.ones(2)}, step=step).wait(timeout=60)
    daemon.stop()
    # The operator lowers retention; it applies at the next commit or gc, not at start-up.
    daemon.config_path.write_text(daemon.config_path.read_text().replace("nvme = 0", "nvme = 1"))
    daemon.start()
    r = daemon.cli("gc", "--dry-run", "--address", daemon.address)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "would remove nvme dry step 1: older than the newest 1 complete steps",
        "would remove nvme dry step 2: older than the newest 1 complete steps",
    ]
    assert sorted(int(p.name) for p in (daemon.root / "dry").iterdir()) == [1, 2, 3]
    with ckpt.Checkpointer(job="dry", address=daemon.address) as c:
        c.load(step=2)  # a load reads the files itself: the step stays while it may
    r = daemon.cli("gc", "--dry-run", "--address", daemon.address)
    assert r.stdout.splitlines() == ["would remove nvme dry step 1: older than the newest 1 complete steps"]
    r = daemon.cli("gc", "--address", daemon.address)
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "removed nvme dry step 1: older than the newest 1 complete steps"
    ]
    assert sorted(int(p.name) for p in (daemon.root / "dry").iterdir()) == [2, 3]


def test_bad_input_gets_clear_errors_and_the_daemon_stays_up(daemon):
    for job in ("../x", "", "x" * 200):
        with pytest.raises(ckpt.InvalidArgument, match="invalid job name"):
            ckpt.Checkpointer(job=job, address=daemon.address)
    with ckpt.Checkpointer(job="bad", address=daemon.address) as c:
        with pytest.raises(ckpt.InvalidArgument, match="invalid step"):
            c.save_async({"x": torch.ones(1)}, step=-1)
        with pytest.raises(ckpt.InvalidArgument, match="cannot be checkpointed"):
            c.save_async({"f": lambda: None}, step=1)
        with pytest.raises(ckpt.NotFound):
            c.load(99)
        c.save_async({"x": torch.ones(1)}, step=1).wait(timeout=60)
        again = c.save_async({"x": torch.zeros(1)}, step=1)  # e.g. a job restarted from an older step
        assert again.skipped and "already complete" in again.reason
        assert torch.equal(c.load(1)["x"], torch.ones(1))
    # Raw RPCs with hostile fields: the daemon answers INVALID_ARGUMENT and keeps serving.
    from ckpt.transport import DaemonClient
    from ckpt_core.wire.v1 import ckptd_pb2 as pb

    raw = DaemonClient(daemon.address)
    hostile = [
        ("Reserve", pb.ReserveRequest(shard=pb.ShardId(job="../../etc", step=1, rank=0, world_size=1))),
        ("Reserve", pb.ReserveRequest(shard=pb.ShardId(job="ok", step=-5, rank=0, world_size=1))),
        ("Reserve", pb.ReserveRequest(shard=pb.ShardId(job="ok", step=1, rank=3, world_size=2))),
        ("Commit", pb.CommitRequest(shard=pb.ShardId(job="ok", step=1, rank=0, world_size=1), slot_path="/etc/passwd")),
        ("Commit", pb.CommitRequest(shard=pb.ShardId(job="ok", step=1, rank=0, world_size=1), layout_json=b"\xff")),
        ("WaitShard", pb.WaitShardRequest(shard=pb.ShardId(job="ok", step=1, rank=0, world_size=1), tier="tape")),
        ("Locate", pb.LocateRequest(job="ok/../..", step=-1)),
        ("List", pb.ListRequest(newest=True)),  # the newest step of which job?
    ]
    for method, request in hostile:
        with pytest.raises(ckpt.InvalidArgument):
            raw.call(method, request)
    raw.close()
    assert daemon.proc.poll() is None
    assert daemon.cli("status", "--json", "--address", daemon.address).returncode == 0


def test_daemon_not_running_is_a_clear_error(short_tmp):
    with (
        ckpt.Checkpointer(job="x", address=str(short_tmp / "nobody.sock")) as c,
        pytest.raises(ckpt.DaemonUnavailable, match="ckptd serve"),
    ):
        c.save_async({"x": torch.ones(1)})


def test_sigterm_drains_in_flight_flushes_and_exits_0(daemon):
    state = {"big": torch.randn(64 << 18)}
    with ckpt.Checkpointer(job="drain", address=daemon.address) as c:
        c.save_async(state, step=1)
    assert daemon.stop() == 0
    assert (daemon.root / "drain" / "1" / COMMIT_NAME).exists()


def test_second_daemon_on_the_same_socket_refuses(daemon):
    r = subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "already serving" in r.stderr  # README: one daemon per root or address, exit 2


def _serve(daemon) -> subprocess.CompletedProcess[str]:
    """Run `ckptd serve` for a daemon that is expected to refuse to start (it would serve on otherwise)."""
    return subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_daemon_on_the_same_root_refuses_naming_the_first(make_daemon):
    first = make_daemon(name="first").start()
    with ckpt.Checkpointer(job="held", address=first.address) as c:
        c.save_async({"x": torch.arange(10)}, step=1).wait(timeout=60)
    in_flight = first.root / "held" / "2" / f"{data_name(0)}.0123abcd.partial"  # as a flush under way has it
    in_flight.parent.mkdir()
    in_flight.write_bytes(b"being written")

    second = make_daemon(name="second", root=first.root)  # its own socket and staging directory
    r = _serve(second)
    assert r.returncode == 2, r.stderr
    assert f"NVMe root {first.root} (node.root) is in use" in r.stderr
    assert f"pid {first.proc.pid}, socket {first.socket}" in r.stderr
    assert in_flight.exists() and not second.socket.exists()  # it touched nothing of the first one's
    assert first.cli("status", "--json").returncode == 0

    assert first.stop() == 0
    second.start()  # the root is free once its daemon stopped
    lock = json.loads((first.root / ".ckptd-lock").read_text())
    assert lock == {"pid": second.proc.pid, "socket": str(second.socket)}
    second.kill()
    second.start()  # and once it was killed: the kernel drops the lock with the process
    with ckpt.Checkpointer(job="held", address=second.address) as c:
        assert c.latest_step() == 1


@pytest.mark.parametrize("where", ["read-only", "under a file"])
def test_an_nvme_root_that_cannot_be_written_is_a_config_error_naming_it(make_daemon, short_tmp, request, where):
    if where == "read-only":
        root = request.getfixturevalue("read_only_dir")
    else:
        (short_tmp / "a-file").write_text("not a directory")
        root = short_tmp / "a-file" / "nvme"
    node = make_daemon(root=root)
    r = _serve(node)
    assert r.returncode == 2, r.stderr
    assert f"config key node.root: cannot write the NVMe root {root}: " in r.stderr
    assert "Traceback" not in r.stderr


def _hold_staging(daemon, job, size_bytes):
    """Reserve a slot as a rank in the middle of its copy would, and never commit it."""
    from ckpt.transport import DaemonClient
    from ckpt_core.wire.v1 import ckptd_pb2 as pb

    raw = DaemonClient(daemon.address)
    reply = raw.call(
        "Reserve", pb.ReserveRequest(shard=pb.ShardId(job=job, step=1, rank=0, world_size=1), size_bytes=size_bytes)
    )
    assert not reply.skipped
    return raw


def test_skip_policy_reports_the_skipped_save(make_daemon):
    daemon = make_daemon(f'policy = "skip"\nbudget_bytes = {8 << 20}\n').start()
    # The [staging] table is the last one written by the fixture, so the keys above land in it.
    raw = _hold_staging(daemon, "other", 6 << 20)
    with ckpt.Checkpointer(job="skipper", address=daemon.address) as c:
        h = c.save_async({"x": torch.ones(1 << 20)}, step=1)  # 4 MiB: no room left in the 8 MiB budget
        assert h.skipped and "budget" in h.reason
        assert not h.done("nvme")
        with pytest.raises(ckpt.SaveSkipped, match="skipped"):
            h.wait("nvme", timeout=5)
        raw.close()
        with pytest.raises(ckpt.InvalidArgument, match="cannot fit"):
            c.save_async({"x": torch.ones(4 << 20)}, step=2)  # 16 MiB never fits an 8 MiB budget
    status = json.loads(daemon.cli("status", "--json", "--address", daemon.address).stdout)
    assert status["counters"]["skipped"] == 1


def test_block_policy_waits_for_room_and_reports_it(make_daemon):
    daemon = make_daemon(f"budget_bytes = {8 << 20}\n").start()
    raw = _hold_staging(daemon, "other", 6 << 20)
    proc = run_rank(daemon, "blocked", 0, 1, [1])
    # The rank is blocked in Reserve until the held slot is given up: the same rank reserving again
    # abandons its unfinished copy, which frees the budget.
    from ckpt_core.wire.v1 import ckptd_pb2 as pb

    raw.call("Reserve", pb.ReserveRequest(shard=pb.ShardId(job="other", step=2, rank=0, world_size=1), size_bytes=1))
    assert "durable" in finish(proc)
    raw.close()


def test_full_disk_fails_the_save_clearly_and_the_daemon_stays_up(make_daemon, small_disk):
    daemon = make_daemon(root=small_disk).start()
    with ckpt.Checkpointer(job="full", address=daemon.address) as c:
        h = c.save_async({"x": torch.ones(4 << 20)}, step=1)  # 16 MiB onto 8 MiB
        with pytest.raises(ckpt.SaveFailed, match="No space left on device"):
            h.wait("nvme", timeout=60)
        c.save_async({"x": torch.ones(1000)}, step=2).wait("nvme", timeout=60)  # still serving
    assert not list(small_disk.rglob("*.partial"))
    assert sorted(p.name for p in (small_disk / "full").iterdir()) == ["2"]  # no empty directory of step 1
    status = json.loads(daemon.cli("status", "--json", "--address", daemon.address).stdout)
    assert "No space left" in status["recent_errors"][0]["error"]
    daemon.stop()


def test_a_shard_of_an_incomplete_step_can_be_saved_again(daemon):
    # Rank 0 saved step 1, rank 1 died first; the job restarts and both save step 1 again.
    with ckpt.Checkpointer(job="again", rank=0, world_size=2, address=daemon.address) as c:
        c.save_async({"x": torch.zeros(3)}, step=1).wait(timeout=60)
        c.save_async({"x": torch.ones(3)}, step=1).wait(timeout=60)
    with ckpt.Checkpointer(job="again", rank=1, world_size=2, address=daemon.address) as c:
        c.save_async({"x": torch.ones(3)}, step=1).wait(timeout=60)
        assert c.latest_step() == 1
    assert torch.equal(ckpt.load_local(daemon.root / "again" / "1", rank=0)["x"], torch.ones(3))


def test_a_step_whose_commit_record_was_lost_in_a_crash_is_committed_on_start(daemon):
    with ckpt.Checkpointer(job="recommit", address=daemon.address) as c:
        c.save_async({"x": torch.arange(5)}, step=1).wait(timeout=60)
    daemon.stop()
    (daemon.root / "recommit" / "1" / COMMIT_NAME).unlink()  # crashed after the last shard, before the record
    daemon.start()
    assert [(s["step"], "nvme" in s["tiers"]) for s in ls_json(daemon)] == [(1, True)]
    assert daemon.cli("verify", "--job", "recommit", "--tier", "nvme").returncode == 0


def test_a_damaged_commit_record_is_not_complete_and_loads_fall_back(daemon):
    state = {"x": torch.arange(100)}
    with ckpt.Checkpointer(job="badrec", address=daemon.address) as c:
        c.save_async(state, step=1).wait(timeout=60)
        c.save_async(state, step=2).wait(timeout=60)
    flip_byte(daemon.root / "badrec" / "2" / COMMIT_NAME, 40)
    steps = {s["step"]: s["tiers"] for s in ls_json(daemon)}
    assert steps == {1: ["memory", "nvme"], 2: ["memory"]}
    with ckpt.Checkpointer(job="badrec", address=daemon.address) as c:
        assert c.latest_step() == 2
        assert_same(state, c.load(2))  # from memory
        with pytest.raises(ckpt.NotFound):
            c.load(2, tier="nvme")
    daemon.stop()
    flip_byte(daemon.root / "badrec" / "1" / "rank-00000.meta.json", 30)
    daemon.start()  # damaged records do not stop the daemon; a damaged commit record is rebuilt from the shards
    assert {s["step"]: s["tiers"] for s in ls_json(daemon)} == {1: ["memory", "nvme"], 2: ["memory", "nvme"]}
    assert list((daemon.root / "badrec" / "2").glob(COMMIT_NAME + ".damaged-*"))
    with ckpt.Checkpointer(job="badrec", address=daemon.address) as c:
        assert_same(state, c.load(2, tier="nvme"))
        with pytest.raises(ckpt.CorruptCheckpoint, match="rank 0 shard metadata of badrec step 1"):
            c.load(1, tier="nvme")


def test_load_local_of_an_incomplete_directory_says_so(tmp_path):
    (tmp_path / "7").mkdir()
    with pytest.raises(ckpt.NotFound, match="no complete step"):
        ckpt.load_local(tmp_path / "7")


@pytest.mark.parametrize(
    "args",
    [["restore", "--job", "j", "--from", "tape", "--to", "/tmp/x"], ["verify", "--job", "j", "--tier", "floppy"]],
)
def test_an_unknown_tier_is_a_usage_error(daemon, args):
    r = daemon.cli(*args)
    assert r.returncode == 2 and "invalid tier" in r.stderr


def test_many_steps_of_two_ranks_commit_without_a_race(daemon):
    procs = [run_rank(daemon, "race", r, 2, list(range(1, 9))) for r in range(2)]
    for p in procs:
        finish(p)
    status = json.loads(daemon.cli("status", "--json", "--address", daemon.address).stdout)
    assert status["recent_errors"] == []
    assert daemon.cli("verify", "--job", "race", "--tier", "nvme").returncode == 0
    assert daemon.cli("gc", "--address", daemon.address).returncode == 0  # waits for retention in flight
    assert [s["step"] for s in ls_json(daemon) if "nvme" in s["tiers"]] == [6, 7, 8]


def test_a_reservation_lost_to_a_daemon_restart_is_refused_and_the_save_goes_on(daemon):
    from ckpt.transport import DaemonClient
    from ckpt_core.errors import ReservationLost
    from ckpt_core.wire.v1 import ckptd_pb2 as pb

    shard = pb.ShardId(job="restart", step=1, rank=0, world_size=1)
    raw = DaemonClient(daemon.address)
    reserved = raw.call("Reserve", pb.ReserveRequest(shard=shard, size_bytes=1000))
    daemon.kill()
    daemon.start()
    commit = pb.CommitRequest(
        shard=shard,
        slot_path=reserved.slot_path,
        data_size_bytes=1000,
        layout_json=b'{"tensors": []}',
        reservation=reserved.reservation,
    )
    with pytest.raises(ReservationLost):
        raw.call("Commit", commit)
    raw.close()
    with ckpt.Checkpointer(job="restart", address=daemon.address) as c:
        c.save_async({"x": torch.ones(3)}, step=1).wait(timeout=60)
        assert torch.equal(c.load(1)["x"], torch.ones(3))


def test_a_step_is_never_sealed_from_shards_of_two_runs(daemon):
    def save(run_id, rank, step, value):
        with ckpt.Checkpointer(job="runs", rank=rank, world_size=2, address=daemon.address, run_id=run_id) as c:
            c.save_async({"x": torch.full((4,), value)}, step=step).wait(timeout=60)

    save("run-a", 0, 1, 1.0)
    save("run-a", 1, 1, 1.0)
    save("run-a", 0, 2, 2.0)  # then run a dies before rank 1 saves step 2
    save("run-b", 1, 2, 20.0)  # run b resumed from step 1
    assert [s["step"] for s in ls_json(daemon)] == [1]  # rank 0's step 2 is from run a: not sealed with it
    save("run-b", 0, 2, 20.0)
    assert [s["step"] for s in ls_json(daemon) if "nvme" in s["tiers"]] == [1, 2]
    for rank in range(2):
        assert torch.equal(ckpt.load_local(daemon.root / "runs" / "2", rank=rank)["x"], torch.full((4,), 20.0))


def test_a_failed_restore_leaves_nothing_half_restored(daemon):
    for rank in range(2):
        with ckpt.Checkpointer(job="half", rank=rank, world_size=2, address=daemon.address) as c:
            c.save_async({"x": torch.randn(1 << 20)}, step=1).wait(timeout=60)
    flip_byte(daemon.root / "half" / "1" / data_name(1), 100)  # rank 0 restores, rank 1 has no good copy
    r = daemon.cli("restore", "--job", "half", "--from", "nvme", "--to", str(daemon.base / "out"))
    assert r.returncode == 1 and "no good copy of rank 1" in r.stderr
    assert "rank 0/2: 4194304 bytes from nvme, verified" in r.stderr
    assert not (daemon.base / "out" / "half" / "1").exists()


def test_map_location_moves_every_tensor_wherever_it_sits(daemon):
    state = {"t": torch.ones(3), "nt": Point(torch.zeros(2), 1), "obj": Holder(torch.arange(4))}
    with ckpt.Checkpointer(job="maploc", address=daemon.address) as c:
        c.save_async(state, step=1).wait(timeout=60)
        moved = c.load(1, map_location="meta")  # a device every machine has
        assert {moved["t"].device.type, moved["nt"].x.device.type, moved["obj"].tensor.device.type} == {"meta"}
        assert moved["nt"].y == 1 and moved["obj"].tensor.shape == (4,)
        with pytest.raises(ckpt.InvalidArgument, match="map_location"):
            c.load(1, map_location="floppy:0")


def test_a_load_whose_copy_vanished_under_it_asks_the_daemon_again(daemon, monkeypatch):
    from ckpt import load_path

    with ckpt.Checkpointer(job="vanish", address=daemon.address) as c:
        c.save_async({"w": torch.arange(10)}, step=1).wait("nvme", timeout=60)
        real, calls = load_path.load_first_good, []

        def vanished_once(sources, rank, map_location, **kwargs):
            calls.append([s.tier for s in sources])
            if len(calls) == 1:  # as if retention (or an operator) removed the copy between Locate and the read
                raise ckpt.NotFound(f"{sources[0].path}: data file missing")
            return real(sources, rank, map_location, **kwargs)

        monkeypatch.setattr(load_path, "load_first_good", vanished_once)
        assert torch.equal(c.load(1)["w"], torch.arange(10))
        assert len(calls) == 2
