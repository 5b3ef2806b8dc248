"""What operators script against: --json on every command, and JSON-lines logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import ckpt
import pytest
import torch
from ckpt_core.format import data_name
from conftest import CKPTD

pytestmark = pytest.mark.e2e


def test_every_command_speaks_json_and_the_daemon_logs_json_lines(make_daemon, short_tmp):
    node = make_daemon("[retention]\nnvme = 1\n")
    node.serve_args = ["--log-json"]
    node.start()
    with ckpt.Checkpointer(job="ops", address=node.address) as c:
        for step in (1, 2):
            c.save_async({"w": torch.arange(10) * step}, step=step).wait(timeout=60)

    status = json.loads(node.cli("status", "--json").stdout)
    assert status["counters"]["saves"] == 2
    listed = json.loads(node.cli("ls", "--json").stdout)
    assert [s["step"] for s in listed if "nvme" in s["tiers"]] == [2]
    out = node.cli("verify", "--job", "ops", "--tier", "nvme", "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout) == [{"tier": "nvme", "job": "ops", "step": 2, "rank": 0, "error": "", "ok": True}]
    out = node.cli("gc", "--dry-run", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == []
    out = node.cli("restore", "--job", "ops", "--to", str(short_tmp / "out"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"job": "ops", "step": 2, "dir": str(short_tmp / "out" / "ops" / "2")}
    assert "rank 0/1: reading" in out.stderr  # progress, a line per event when stderr is not a terminal

    node.stop()
    lines = [json.loads(line) for line in node.log().splitlines()]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert lines[0]["time"].endswith("Z")  # UTC, the same on every node
    assert any(line["message"].startswith("ckptd serving on") for line in lines)
    assert lines[-1]["message"] == "stopped"


def test_environment_overrides_reach_a_real_daemon_and_a_bad_one_stops_it(make_daemon):
    node = make_daemon("[retention]\nnvme = 5\n")
    node.env = {"CKPTD_RETENTION__NVME": "1"}  # over the file's 5
    node.start()
    with ckpt.Checkpointer(job="env", address=node.address) as c:
        for step in (1, 2, 3):
            c.save_async({"w": torch.ones(4)}, step=step).wait(timeout=60)
    node.cli("gc")
    assert sorted(p.name for p in (node.root / "env").iterdir()) == ["3"]
    node.stop()

    out = subprocess.run(
        [*CKPTD, "serve", "--config", str(node.config_path)],
        env={**os.environ, "CKPTD_STAGING__POLICY": "sometimes"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "staging.policy" in out.stderr


@pytest.mark.parametrize("command", ["serve", "status", "ls", "restore", "verify", "gc"])
def test_every_command_has_help(command):
    out = subprocess.run([*CKPTD, command, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--config" in out.stdout
    if command != "serve":
        assert "examples:\n  ckptd " + command in out.stdout


def test_gc_all_removes_a_finished_job_from_the_node_and_the_store_only_when_named(make_daemon, short_tmp):
    store = short_tmp / "store"
    node = make_daemon(f'[object]\nurl = "file://{store}"\n').start()
    for job in ("old", "keep"):
        with ckpt.Checkpointer(job=job, rank=0, world_size=1, address=node.address) as c:
            for step in (1, 2):
                c.save_async({"w": torch.full((100,), step)}, step=step).wait("object", timeout=60)

    def gc(*args: str) -> subprocess.CompletedProcess[str]:
        return node.cli("gc", "--address", node.address, *args)

    assert gc("--all").returncode == 2 and gc("--job", "old", "--tier", "object").returncode == 2
    planned = json.loads(gc("--job", "old", "--all", "--tier", "object", "--dry-run", "--json").stdout)
    assert {(r["tier"], r["step"]) for r in planned} == {("memory", 2), ("memory", 1), ("nvme", 1), ("nvme", 2),
                                                        ("object", 1), ("object", 2)}  # fmt: skip
    assert (node.staging_dir / "old").exists() and (node.root / "old" / "1").exists()  # a dry run removes nothing

    def newest() -> dict[str, list[str]]:
        doc = json.loads(node.cli("status", "--json", "--address", node.address).stdout)
        return {job: list(tiers) for job, tiers in doc["newest_complete"].items()}

    assert newest() == {"old": ["memory", "nvme", "object"], "keep": ["memory", "nvme", "object"]}
    removed = json.loads(gc("--job", "old", "--all", "--json").stdout)
    assert {r["tier"] for r in removed} == {"memory", "nvme"}  # the store's copies stay: --tier object not named
    assert not (node.staging_dir / "old").exists() and not list((node.root / "old").glob("[0-9]*"))
    assert (store / "old" / "2").exists()
    listed = json.loads(node.cli("ls", "--json", "--address", node.address).stdout)
    assert {(s["job"], tuple(s["tiers"])) for s in listed if s["job"] == "old"} == {("old", ("object",))}
    assert {s["step"] for s in listed if s["job"] == "keep" and "nvme" in s["tiers"]} == {1, 2}  # untouched

    assert newest() == {"old": ["object"], "keep": ["memory", "nvme", "object"]}  # reported where it still is
    assert gc("--job", "old", "--all", "--tier", "object").returncode == 0
    assert newest() == {"keep": ["memory", "nvme", "object"]}
    assert not [s for s in json.loads(node.cli("ls", "--json", "--address", node.address).stdout) if s["job"] == "old"]
    assert not [p for p in store.rglob("*") if p.is_file() and "old" in p.parts]  # its shards under every prefix too
    assert [p for p in store.rglob("*") if p.is_file() and "keep" in p.parts]


def test_every_thread_of_the_daemon_runs_on_the_cpus_of_node_cpus(make_daemon):
    cpu = max(os.sched_getaffinity(0))
    node = make_daemon()
    node.env["CKPTD_NODE__CPUS"] = f'"{cpu}"'  # the fixture's config already has its [node] table
    node.start()
    with ckpt.Checkpointer(job="pinned", address=node.address) as c:
        c.save_async({"w": torch.arange(1000)}, step=1).wait("nvme", timeout=60)  # the flush threads exist now
    assert node.proc is not None
    tasks = list(Path(f"/proc/{node.proc.pid}/task").iterdir())
    assert len(tasks) > 3
    for task in tasks:
        lines = (task / "status").read_text().splitlines()
        allowed = next(line for line in lines if line.startswith("Cpus_allowed_list"))
        assert allowed.split(":")[1].strip() == str(cpu), (task, allowed)
    status = json.loads(node.cli("status", "--json", "--address", node.address).stdout)
    assert status["cpus"] == [cpu]
    assert f"running on CPUs {cpu}" in node.log()


def test_status_shows_each_jobs_newest_complete_step_and_its_age_per_tier(make_daemon):
    node = make_daemon().start()
    assert "no complete step seen by this daemon yet" in node.cli("status").stdout
    for job, steps in (("llama-7b", (10, 20, 30)), ("bert", (5,))):
        with ckpt.Checkpointer(job=job, address=node.address) as c:
            for step in steps:
                c.save_async({"w": torch.full((100,), step)}, step=step).wait("nvme", timeout=60)

    out = node.cli("status")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["JOB", "TIER", "NEWEST", "STEP", "AGE"])
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [row[:3] for row in rows] == [
        ["bert", "memory", "5"],
        ["bert", "nvme", "5"],
        ["llama-7b", "memory", "30"],
        ["llama-7b", "nvme", "30"],
    ]
    assert all(row[4] == "s" and 0 <= int(row[3]) < 90 for row in rows)  # "12 s": seconds, just now
    step_ends = lines[header].index("NEWEST STEP") + len("NEWEST STEP")  # steps right-aligned under their title
    assert all(line[:step_ends].endswith(" " + row[2]) for line, row in zip(lines[header + 1 :], rows, strict=False))


def test_inspect_lists_a_steps_tensors_from_the_cli_as_a_table_and_as_json(daemon):
    state = {"model": {"w": torch.ones(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16)}, "step": 3}
    with ckpt.Checkpointer(job="seen", address=daemon.address) as c:
        c.save_async(state, step=3).wait("nvme", timeout=60)
    found = daemon.cli("inspect", "--job", "seen", "--step", "3", "--json")
    assert found.returncode == 0, found.stderr
    doc = json.loads(found.stdout)
    rows = {row["key"]: row for row in doc["tensors"]}
    assert (doc["job"], doc["step"], doc["world_size"]) == ("seen", 3, 1)
    assert rows["model.w"] == {
        "key": "model.w", "kind": "tensor", "dtype": "float32", "shape": [64, 32], "size_bytes": 8192, "ranks": [0]
    }  # fmt: skip
    assert rows["model.b"]["dtype"] == "bfloat16" and rows["model.b"]["shape"] == [32]
    table = daemon.cli("inspect", "--job", "seen", "--step", "3")
    assert table.returncode == 0 and "model.w" in table.stdout and "64x32" in table.stdout and "8.0 KiB" in table.stdout
    missing = daemon.cli("inspect", "--job", "seen", "--step", "4")
    assert missing.returncode != 0 and "seen step 4 is not complete" in missing.stderr


def _run(*args: str, env: dict[str, str] | None = None, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess:
    """Run a ckptd command with env over ours, where $CKPTD_ADDRESS is set only if env sets it."""
    base = {k: v for k, v in os.environ.items() if k != "CKPTD_ADDRESS"}
    return subprocess.run(
        [*CKPTD, *args], env={**base, **(env or {})}, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120
    )


def test_ckptd_address_names_the_daemon_every_command_talks_to(make_daemon):
    a, b = make_daemon(name="a").start(), make_daemon(name="b").start()
    with ckpt.Checkpointer(job="addressed", address=b.address) as c:
        c.save_async({"w": torch.arange(10)}, step=1).wait(timeout=60)
    config = ("--config", str(a.config_path))  # a's socket is the configured one
    env = {"CKPTD_ADDRESS": b.address}

    def status(*args: str, env: dict[str, str]) -> str:
        out = _run("status", "--json", *config, *args, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["socket"]

    assert status(env={}) == a.address
    assert status(env=env) == b.address  # $CKPTD_ADDRESS over the configured socket
    assert status("--address", a.address, env=env) == a.address  # --address over both
    listed = _run("ls", "--json", *config, env=env)
    assert listed.returncode == 0, listed.stderr
    assert [(s["job"], s["step"]) for s in json.loads(listed.stdout)] == [("addressed", 1)]
    collected = _run("gc", "--dry-run", "--json", *config, env=env)
    assert collected.returncode == 0 and json.loads(collected.stdout) == []
    a.stop()
    for command in ("status", "ls", "gc"):  # asked about a daemon that is gone: no other one answers instead
        gone = _run(command, "--config", str(b.config_path), env={"CKPTD_ADDRESS": a.address})
        assert gone.returncode == 1 and a.address in gone.stderr, (command, gone.stdout, gone.stderr)


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run a command whose stdout is a pipe that nobody reads any more (`| head -1` once head is done)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return _run(*args, stdout=write_end)
    finally:
        os.close(write_end)


def test_output_to_a_closed_pipe_ends_quietly_with_the_commands_own_status(daemon):
    with ckpt.Checkpointer(job="piped", address=daemon.address) as c:
        c.save_async({"w": torch.arange(1000)}, step=1).wait("nvme", timeout=60)
    config = ("--config", str(daemon.config_path))

    for args, status in ((("status",), 0), (("ls", "--job", "piped"), 0), (("verify", "--job", "piped"), 0)):
        out = _into_a_closed_pipe(*args, *config)
        assert out.returncode == status, (args, out.stderr)
        assert "Broken pipe" not in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)

    data = daemon.root / "piped" / "1" / data_name(0)
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = _into_a_closed_pipe("verify", "--job", "piped", "--tier", "nvme", *config)
    assert out.returncode == 1 and "0 of 1 shards check" in out.stderr  # 1: a bad byte, not the pipe
    assert "Broken pipe" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("where", ["read-only", "under a file"])
def test_restore_into_a_destination_that_cannot_be_written_says_so(daemon, short_tmp, request, where):
    with ckpt.Checkpointer(job="dest", address=daemon.address) as c:
        c.save_async({"w": torch.arange(1000)}, step=1).wait("nvme", timeout=60)
    if where == "read-only":
        to = request.getfixturevalue("read_only_dir")
    else:
        (short_tmp / "a-file").write_text("not a directory")
        to = short_tmp / "a-file" / "restore"

    out = daemon.cli("restore", "--job", "dest", "--to", str(to))
    assert out.returncode == 1
    error = out.stderr.splitlines()[-1]
    assert error.startswith(f"ckptd: cannot write the restore destination {to}: "), out.stderr
    assert "no good copy" not in out.stderr and "trying the next tier" not in out.stderr  # no tier is blamed


def test_status_shows_sizes_in_binary_units_and_no_python_dicts(daemon):
    with ckpt.Checkpointer(job="sized", address=daemon.address) as c:
        c.save_async({"w": torch.ones(3 << 20)}, step=1).wait("nvme", timeout=60)  # 12 MiB

    out = daemon.cli("status")
    assert out.returncode == 0, out.stderr
    staging = next(line for line in out.stdout.splitlines() if line.startswith("staging "))
    assert re.search(r": \d+\.\d (MiB|GiB) in \d+ slots", staging), staging
    assert re.search(r"\bbytes_saved 12\.\d MiB\b", out.stdout), out.stdout
    assert re.search(r"\bbytes_flushed 12\.\d MiB\b", out.stdout), out.stdout
    assert re.search(r"verification_failures: memory 0, nvme 0, peer 0, object 0$", out.stdout, re.M), out.stdout
    assert "{" not in out.stdout and "}" not in out.stdout, out.stdout
    assert not re.search(r"\d{4,} bytes", out.stdout), out.stdout
