"""Retention per job, against real daemons: keep_every, the client's keep over the config's, pins, `ckptd rm`."""

from __future__ import annotations

import json
import subprocess

import ckpt
import pytest
import torch
from conftest import CKPTD, eventually

pytestmark = pytest.mark.e2e


def save(daemon, job, steps, **options):
    with ckpt.Checkpointer(job=job, address=daemon.address, **options) as c:
        for step in steps:
            c.save_async({"w": torch.full((4,), float(step))}, step=step).wait("nvme", timeout=60)


def on_nvme(daemon, job):
    return sorted(int(p.name) for p in (daemon.root / job).iterdir() if p.name.isdigit())


def listed(daemon, job):
    out = daemon.cli("ls", "--job", job, "--json")
    assert out.returncode == 0, out.stderr
    return [s["step"] for s in json.loads(out.stdout)]


def retention(daemon, job):
    return json.loads(daemon.cli("status", "--json").stdout)["retention"][job]


def test_keep_every_keeps_the_multiples_while_keep_drops_the_others(make_daemon):
    node = make_daemon("[retention]\nnvme = 5\n[retention.jobs.long]\nkeep = 2\nkeep_every = 4\n").start()
    save(node, "long", range(1, 10))
    assert node.cli("gc").returncode == 0
    assert on_nvme(node, "long") == [4, 8, 9]  # multiples of 4, and the newest 2 (8, 9)
    assert retention(node, "long") == {
        "keep": {"nvme": 2, "peer": 2, "object": 0},
        "keep_every": 4,
        "pinned": [],
        "from": {"keep": "config", "keep_every": "config"},
    }
    assert "retention long: newest nvme 2, peer 2, object all; every multiple of 4" in node.cli("status").stdout


def test_the_clients_keep_wins_over_the_config(make_daemon):
    node = make_daemon("[retention.jobs.mine]\nkeep = 1\n").start()
    save(node, "mine", range(1, 6), keep=3)
    node.cli("gc")
    assert on_nvme(node, "mine") == [3, 4, 5]
    r = retention(node, "mine")
    assert r["keep"]["nvme"] == 3 and r["from"] == {"keep": "client", "keep_every": "default"}


def test_a_later_checkpointer_without_keep_takes_the_config_back(make_daemon):
    node = make_daemon("[retention]\nnvme = 1\n").start()
    save(node, "back", range(1, 8), keep=2, keep_every=5)
    node.cli("gc")
    assert on_nvme(node, "back") == [5, 6, 7]
    assert retention(node, "back")["from"] == {"keep": "client", "keep_every": "client"}
    node.stop()  # remembered across a restart, until the job's next save says otherwise
    node.start()
    assert retention(node, "back")["from"] == {"keep": "client", "keep_every": "client"}
    save(node, "back", [8])  # keep=None, keep_every=None: the config's
    r = retention(node, "back")
    assert r["keep"]["nvme"] == 1 and r["keep_every"] == 0
    assert r["from"] == {"keep": "default", "keep_every": "default"}
    node.cli("gc")
    assert on_nvme(node, "back") == [8]


def test_a_pinned_step_survives_retention_and_restarts_and_goes_after_unpin(make_daemon):
    node = make_daemon("[retention]\nnvme = 1\n").start()
    save(node, "p", [1])
    out = node.cli("pin", "--job", "p", "--step", "1")
    assert out.returncode == 0, out.stderr
    assert "pinned p step 1; pinned steps of p: 1" in out.stdout
    out = node.cli("pin", "--job", "p", "--step", "7")  # not complete here
    assert out.returncode == 1 and "p step 7 is not complete on any tier of this node" in out.stderr
    assert "complete steps here, newest first (all 1): 1" in out.stderr
    save(node, "p", [2, 3])
    node.cli("gc")
    assert on_nvme(node, "p") == [1, 3]
    shown = json.loads(node.cli("ls", "--job", "p", "--json").stdout)
    assert {s["step"]: s["pinned"] for s in shown if "nvme" in s["tiers"]} == {1: True, 3: False}
    assert next(line for line in node.cli("ls", "--job", "p").stdout.splitlines() if " 1 " in line).endswith("pinned")

    node.stop()  # pins live under the node root: a restarted daemon keeps them
    node.start()
    assert retention(node, "p")["pinned"] == [1]
    node.cli("gc")
    assert on_nvme(node, "p") == [1, 3]

    out = node.cli("unpin", "--job", "p", "--step", "1", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == {"job": "p", "pinned": []}
    save(node, "p", [4])  # the next save's pass removes it
    eventually(lambda: on_nvme(node, "p") == [4], 30, "the unpinned step's removal")


def test_rm_removes_a_step_and_the_head_only_with_force(make_daemon):
    node = make_daemon("[retention]\nnvme = 0\n").start()
    save(node, "r", [1, 2, 3])

    out = node.cli("rm", "--job", "r", "--step", "1", "--dry-run")
    assert out.returncode == 0 and out.stdout.splitlines() == ["would remove nvme r step 1: removed by ckptd rm"]
    assert listed(node, "r") == [1, 2, 3]
    out = node.cli("rm", "--job", "r", "--step", "2")  # in memory too: each rank keeps its two newest snapshots
    assert out.returncode == 0, out.stderr
    assert "removed nvme r step 2: removed by ckptd rm" in out.stdout.splitlines()
    assert listed(node, "r") == [1, 3] and on_nvme(node, "r") == [1, 3]

    out = node.cli("rm", "--job", "r", "--step", "3")
    assert out.returncode == 1
    assert "r step 3 is the job's head" in out.stderr and "--force" in out.stderr
    assert listed(node, "r") == [1, 3]
    out = node.cli("rm", "--job", "r", "--step", "3", "--force", "--json")
    assert out.returncode == 0, out.stderr
    assert {(r["tier"], r["step"]) for r in json.loads(out.stdout)} >= {("nvme", 3), ("memory", 3)}
    assert listed(node, "r") == [1]

    out = node.cli("rm", "--job", "r", "--step", "42")
    assert out.returncode == 1 and "r step 42 is on no tier of this node" in out.stderr and "(all 1): 1" in out.stderr
    assert node.cli("rm", "--job", "r/x", "--step", "1").returncode == 2


@pytest.mark.parametrize("command", ["pin", "unpin", "rm"])
def test_the_new_commands_have_help(command):
    out = subprocess.run([*CKPTD, command, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--job" in out.stdout and "examples:\n  ckptd " + command in out.stdout


def test_rm_removes_the_step_from_the_object_store_too_and_pins_count_there(make_daemon, short_tmp):
    store = short_tmp / "store"
    node = make_daemon(f'[object]\nurl = "file://{store}"\n[retention]\nnvme = 0\nobject = 1\n').start()
    with ckpt.Checkpointer(job="o", address=node.address) as c:
        c.save_async({"w": torch.ones(4)}, step=1).wait("object", timeout=60)
        assert node.cli("pin", "--job", "o", "--step", "1").returncode == 0
        for step in (2, 3):
            c.save_async({"w": torch.ones(4) * step}, step=step).wait("object", timeout=60)
    node.cli("gc")
    assert sorted(p.name for p in (store / "o").iterdir()) == ["1", "3"]  # object = 1 keeps 3, the pin keeps 1

    out = node.cli("rm", "--job", "o", "--step", "1")
    assert out.returncode == 1 and "o step 1 is pinned" in out.stderr and "--force" in out.stderr
    out = node.cli("rm", "--job", "o", "--step", "1", "--force", "--json", "--tier", "object")
    assert out.returncode == 0, out.stderr
    assert {r["tier"] for r in json.loads(out.stdout)} >= {"nvme", "object"}
    assert sorted(p.name for p in (store / "o").iterdir()) == ["3"]
    assert on_nvme(node, "o") == [2, 3]
    assert retention(node, "o")["pinned"] == []  # the removed step's pin went with it


def test_rm_leaves_the_shared_object_store_alone_unless_asked(make_daemon, short_tmp):
    store = short_tmp / "store"
    node = make_daemon(f'[object]\nurl = "file://{store}"\n[retention]\nnvme = 0\n').start()
    with ckpt.Checkpointer(job="s", address=node.address) as c:
        for step in (1, 2):
            c.save_async({"w": torch.ones(4) * step}, step=step).wait("object", timeout=60)
    out = node.cli("rm", "--job", "s", "--step", "1")
    assert out.returncode == 0, out.stderr
    assert "removed nvme s step 1: removed by ckptd rm" in out.stdout
    assert "removed object" not in out.stdout
    assert f"the object store (file://{store}) was left alone: --tier object removes the step there too" in out.stdout
    assert on_nvme(node, "s") == [2] and sorted(p.name for p in (store / "s").iterdir()) == ["1", "2"]
    out = node.cli("rm", "--job", "s", "--step", "1")  # only the store has it now
    assert out.returncode == 1 and "on no tier of this node (the object store not asked: --tier object)" in out.stderr
    out = node.cli("rm", "--job", "s", "--step", "1", "--tier", "object")
    assert out.returncode == 0 and "removed object s step 1: removed by ckptd rm" in out.stdout, out.stderr
    assert sorted(p.name for p in (store / "s").iterdir()) == ["2"]
