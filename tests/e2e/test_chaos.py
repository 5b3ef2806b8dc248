"""A short seeded fault campaign (benchmarks/chaos.py) in CI: 30 faults of every kind, nothing lost or wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


@pytest.mark.timeout(300)
def test_a_short_campaign_loses_nothing_returns_no_wrong_byte_and_lists_nothing_partial(tmp_path):
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(CHAOS), "--faults", "30", "--seed", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    table = json.loads(out.read_text())["table"]
    kinds = {"daemon", "rank", "both", "flip-data", "flip-record", "truncate", "flip-slot"}
    assert kinds <= {k for k, counts in table.items() if counts.get("injected", 0) >= 1}
    assert sum(counts.get("injected", 0) for counts in table.values()) == 30
    assert table["final"]["checked"] >= 1
    assert sum(counts.get("checked", 0) for counts in table.values()) >= 30  # loads compared bit for bit
    for counts in table.values():
        assert (counts.get("lost", 0), counts.get("wrong bytes", 0), counts.get("partial visible", 0)) == (0, 0, 0)
