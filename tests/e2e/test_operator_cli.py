"""What operators script against: --json on every command, and JSON-lines logs."""

from __future__ import annotations

import json

import ckpt
import pytest
import torch

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
    assert any(line["message"].startswith("ckptd serving on") for line in lines)
    assert lines[-1]["message"] == "stopped"
