"""A short seeded fault campaign (benchmarks/chaos.py) in CI: 34 faults, every kind, nothing lost, wrong or stuck."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"
FAULTS = 34  # each of the 17 kinds once, then 17 at random: about a minute and a half


@pytest.mark.timeout(300)
def test_a_short_campaign_loses_nothing_returns_no_wrong_byte_and_lists_nothing_partial(tmp_path):
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(CHAOS), "--faults", str(FAULTS), "--seed", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    print(run.stdout)
    result = json.loads(out.read_text())
    table = result["table"]
    kinds = set(result["kinds"]) - set(result["kinds_not_possible_here"])  # a full disk needs a mount
    assert len(kinds) >= 16
    assert kinds <= {k for k, counts in table.items() if counts.get("injected", 0) >= 1}
    assert sum(counts.get("injected", 0) for counts in table.values()) == FAULTS
    assert table["final"]["checked"] >= 1
    assert sum(counts.get("checked", 0) for counts in table.values()) >= FAULTS  # loads compared bit for bit
    assert table["restore"]["checked"] >= 1  # a restore cut short, then done again and loaded
    for counts in table.values():
        assert [counts.get(c, 0) for c in ("lost", "wrong bytes", "partial visible", "not serving again")] == [0] * 4
