"""Saves every step, faster than the disk: real daemons, real files, shards large enough that a flush
(checksums, writes, fsync) takes longer than the copy into shared memory on any machine we run on."""

from __future__ import annotations

import json
import threading
import urllib.request

import ckpt
import pytest
import torch
from ckpt.transport import DaemonClient
from ckpt_core.format import COMMIT_NAME, meta_name
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from conftest import free_port

from ckptd.tiers.slot_files import scan_slots

pytestmark = pytest.mark.e2e
MIB = 1 << 20
STEPS = 12


def _state(size_mib: int, step: int, rank: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size_mib * MIB // 4,), float(step * 10 + rank))}


def _outcomes(handles: dict[int, ckpt.SaveHandle], tier: str = "nvme") -> tuple[set[int], dict[int, str]]:
    """Wait for every handle on tier: return (steps that reached it, step -> why it was passed over)."""
    flushed, passed = set(), {}
    for step, h in handles.items():
        try:
            h.wait(tier, timeout=120)
            flushed.add(step)
        except ckpt.SaveSkipped as e:
            passed[step] = str(e)
    return flushed, passed


def _nvme_steps(daemon, job: str) -> set[int]:
    r = daemon.cli("ls", "--json", "--job", job, "--address", daemon.address)
    assert r.returncode == 0, r.stderr
    return {s["step"] for s in json.loads(r.stdout) if "nvme" in s["tiers"]}


def _save_every_step(daemon, job: str, size_mib: int):
    """Save steps 1 to STEPS back to back, then wait for each: return (handles, flushed steps, passed-over steps)."""
    handles = {}
    states = {step: _state(size_mib, step) for step in range(1, STEPS + 1)}  # built first: saves come back to back
    with ckpt.Checkpointer(job=job, address=daemon.address) as c:
        for step, state in states.items():
            handles[step] = c.save_async(state, step=step)
        flushed, passed = _outcomes(handles)
    return handles, flushed, passed


def test_saves_every_step_never_wait_for_the_disk_and_passed_over_steps_are_reported(make_daemon):
    metrics = f"127.0.0.1:{free_port()}"
    daemon = make_daemon(f'[retention]\nnvme = 0\n[metrics]\nlisten = "{metrics}"\n')
    daemon.env["CKPTD_NVME__FLUSH_EVERY"] = "0"  # the default: the newest snapshot wins the disk
    daemon.start()
    handles, flushed, passed = _save_every_step(daemon, "fast", 64)
    assert not any("NVMe" in h.reason for h in handles.values()), [h.reason for h in handles.values()]
    assert STEPS in flushed and passed, (flushed, passed)  # the disk was slower than the copies: some were replaced
    assert flushed | set(passed) == set(handles) and not flushed & set(passed)
    for step, why in passed.items():
        assert f"fast step {step} rank 0 was passed over on NVMe" in why
        newer = int(why.split("a newer snapshot (step ")[1].split(")")[0])
        assert newer > step
    assert _nvme_steps(daemon, "fast") == flushed  # retention keeps every step: exactly the flushed ones
    for step in flushed:
        assert torch.equal(ckpt.load_local(daemon.root / "fast" / str(step))["w"], _state(64, step)["w"])
    status = json.loads(daemon.cli("status", "--json", "--address", daemon.address).stdout)
    assert status["passed_over"]["fast"]["steps"] == len(passed) == status["counters"]["passed_over"]
    assert status["passed_over"]["fast"]["last_step"] == max(passed)
    text = daemon.cli("status", "--address", daemon.address).stdout
    assert f"passed over fast: {len(passed)} steps" in text
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30) as reply:
        page = reply.read().decode()
    assert f'ckptd_nvme_passed_over_total{{job_name="fast"}} {float(len(passed))}' in page
    assert "passed over on NVMe since the last report" in daemon.log()


def test_with_every_step_flushed_the_same_saves_wait_for_the_disk(make_daemon):
    # The control of the test above: flush_every = 1 is the behaviour before passing over.
    daemon = make_daemon().start()  # the fixture's flush_every = 1
    handles, flushed, passed = _save_every_step(daemon, "slow", 64)
    assert flushed == set(handles) and not passed
    waited = [h.reason for h in handles.values() if "waits for the NVMe flush" in h.reason]
    assert waited, [h.reason for h in handles.values()]


def test_flush_every_keeps_its_multiples_whatever_the_save_rate(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n")
    daemon.env["CKPTD_NVME__FLUSH_EVERY"] = "4"
    daemon.start()
    _, flushed, passed = _save_every_step(daemon, "cadence", 64)
    assert {4, 8, 12} <= flushed and not {4, 8, 12} & set(passed)
    assert passed  # the steps between went as the disk allowed
    assert _nvme_steps(daemon, "cadence") == flushed
    status = json.loads(daemon.cli("status", "--json", "--address", daemon.address).stdout)
    assert status["tiers"]["nvme"]["flush_every"] == 4


def _save_ranks_in_step(daemon, job: str, world_size: int, size_mib: int, steps, wait: bool, after_last=None):
    """Save steps on world_size ranks (threads) that move from step to step together, as after a collective.

    after_last: called once, as soon as every rank's last save_async returned (before any rank waits or closes).
    """
    barrier = threading.Barrier(world_size)
    last_returned = threading.Barrier(world_size, action=after_last)
    outcomes: dict[int, tuple[set[int], dict[int, str]]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            states = {step: _state(size_mib, step, r) for step in steps}  # built first: saves come back to back
            with ckpt.Checkpointer(job=job, rank=r, world_size=world_size, address=daemon.address) as c:
                handles = {}
                for step, state in states.items():
                    barrier.wait(timeout=120)
                    handles[step] = c.save_async(state, step=step)
                last_returned.wait(timeout=120)
                if wait:
                    outcomes[r] = _outcomes(handles)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)
            barrier.abort()
            last_returned.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return outcomes


def test_the_ranks_of_a_job_on_one_node_flush_the_same_steps(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n")
    daemon.env["CKPTD_NVME__FLUSH_EVERY"] = "0"
    daemon.start()
    outcomes = _save_ranks_in_step(daemon, "ranks", 4, 32, range(1, STEPS + 1), wait=True)
    flushed = [outcomes[r][0] for r in range(4)]
    assert all(f == flushed[0] for f in flushed), flushed  # rounds: every rank flushed the same steps
    assert STEPS in flushed[0] and len(flushed[0]) < STEPS
    assert _nvme_steps(daemon, "ranks") == flushed[0]  # and each of them is complete


def test_kill_9_while_saves_outrun_the_disk_loses_nothing_complete_and_recovery_flushes_only_the_newest(
    make_daemon,
):
    daemon = make_daemon("[retention]\nnvme = 0\n")
    daemon.env["CKPTD_NVME__FLUSH_EVERY"] = "0"
    daemon.start()
    # Killed as soon as both ranks' last save_async returned: rounds under way, snapshots waiting.
    _save_ranks_in_step(daemon, "crash", 2, 32, range(1, STEPS + 1), wait=False, after_last=daemon.kill)
    complete_before = {int(p.parent.name) for p in (daemon.root / "crash").glob(f"*/{COMMIT_NAME}")}
    # The shards on disk at the kill. A kill between a step's last shard in place and its commit record:
    # the restart commits that step. One between a round's two shards leaves one shard on disk: its
    # wait says so, its slot keeps it, and the step stays incomplete.
    shards_before = {
        (r, int(d.name)) for d in (daemon.root / "crash").iterdir() for r in range(2) if (d / meta_name(r)).exists()
    }
    whole_before = {step for r, step in shards_before if {(0, step), (1, step)} <= shards_before}
    pending = {  # rank -> the steps its slots hold that no complete step covers
        r: {s.shard.step for s in scan_slots(daemon.staging_dir) if s.shard and s.rank == r} - complete_before
        for r in range(2)
    }
    common = pending[0] & pending[1]
    assert common, (pending, complete_before)  # the disk was behind: something waited for its flush
    newest = max(common)
    daemon.start()
    with ckpt.Checkpointer(job="crash", rank=0, world_size=2, address=daemon.address) as c:
        ckpt.SaveHandle(c, newest, False, 0.0, "").wait("nvme", timeout=120)
        for step in common - {newest} - whole_before:  # a step left whole by the kill is committed instead
            if (0, step) in shards_before:
                ckpt.SaveHandle(c, step, False, 0.0, "").wait("nvme", timeout=120)
                continue
            with pytest.raises(ckpt.SaveSkipped, match=f"crash step {step} rank 0 was passed over"):
                ckpt.SaveHandle(c, step, False, 0.0, "").wait("nvme", timeout=120)
    listed = _nvme_steps(daemon, "crash")
    # Recovery wrote the newest pending step and no older one (it committed what a kill left whole).
    assert complete_before | {newest} <= listed <= complete_before | whole_before | {newest}
    for step in listed:  # every complete step whole and right, rank by rank
        for r in range(2):
            loaded = ckpt.load_local(daemon.root / "crash" / str(step), rank=r)
            assert torch.equal(loaded["w"], _state(32, step, r)["w"])
    verified = daemon.cli("verify", "--job", "crash")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    held = {(s.rank, s.shard.step) for s in scan_slots(daemon.staging_dir) if s.shard}
    stale = {(r, step) for r, step in held if step < newest and step not in listed and (r, step) not in shards_before}
    assert not stale, (stale, listed, pending, shards_before)  # passed over: markers gone


def test_prepare_allocates_the_slots_ahead_and_the_next_save_gets_one(make_daemon):
    daemon = make_daemon().start()
    raw = DaemonClient(daemon.address)
    shard = pb.ShardId(job="ahead", step=0, rank=0, world_size=1)
    try:
        first = raw.call("Reserve", pb.ReserveRequest(shard=shard, size_bytes=10 * MIB + 3, prepare=True))
        assert not first.skipped and first.reservation == 0
        prepared = {first.slot_path, first.spare_slot_path}
        assert len(prepared) == 2 and first.slot_size_bytes == first.spare_slot_size_bytes == 11 * MIB
        again = raw.call("Reserve", pb.ReserveRequest(shard=shard, size_bytes=10 * MIB + 3, prepare=True))
        assert {again.slot_path, again.spare_slot_path} == prepared
        staging = json.loads(daemon.cli("status", "--json", "--address", daemon.address).stdout)["staging"]
        assert staging["slots"] == 2 and staging["in_use_bytes"] == 22 * MIB  # nothing more for the second
        shard.step = 1
        reserved = raw.call("Reserve", pb.ReserveRequest(shard=shard, size_bytes=10 * MIB))
        assert reserved.slot_path in prepared and reserved.reason == "" and reserved.blocked_s == 0
    finally:
        raw.close()
