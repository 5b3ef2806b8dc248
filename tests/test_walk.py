"""Walk one real save with benchmarks/walk_save.py: every leg is reached; the NVMe write leg enters no module twice.

It runs two profiled daemons and a file:// object store, and takes a few seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WALK_TIMEOUT_S = 120


@pytest.mark.e2e
def test_walk_covers_every_leg_and_the_nvme_write_leg_enters_no_module_twice(tmp_path):
    out = tmp_path / "walk.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "walk_save.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=WALK_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr
    legs = json.loads(out.read_text())
    for leg in (
        "saving node: NVMe writes",
        "saving node: replication to the peer",
        "saving node: upload",
        "peer: receive",
    ):
        assert legs.get(leg, {}).get("entries"), f"the walk did not reach {leg}: {sorted(legs)}"
    nvme_writes = Counter(legs["saving node: NVMe writes"]["entries"])
    assert {module: n for module, n in nvme_writes.items() if n > 1} == {}
