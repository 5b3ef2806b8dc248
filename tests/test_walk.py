"""Walk one real save with benchmarks/walk_save.py: every leg is reached, the NVMe write leg enters no module twice,
and INTERNALS's walk of a save names, once each, the types the walk met.

The walk runs two profiled daemons and a file:// object store, once for the module, in a few seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
WALK_TIMEOUT_S = 120
LEGS = ("saving node: NVMe writes", "saving node: replication to the peer", "saving node: upload", "peer: receive")

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("walk") / "walk.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "walk_save.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=WALK_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())


def test_walk_reaches_every_leg_and_the_nvme_write_leg_enters_no_module_twice(walked):
    for leg in LEGS:
        assert walked.get(leg, {}).get("entries"), f"the walk did not reach {leg}: {sorted(walked)}"
    nvme_writes = Counter(walked["saving node: NVMe writes"]["entries"])
    assert {module: n for module, n in nvme_writes.items() if n > 1} == {}


def test_internals_walk_of_a_save_names_each_type_the_walk_met_once(walked):
    text = (REPO / "docs" / "INTERNALS.md").read_text()
    walk = text[text.index("## A walk for newcomers") :]
    save = walk[: walk.index("\nOne load:")]
    named = Counter(re.findall(r"\*\*`(\w+)`\*\*", save))  # each type in bold once (two SavePaths: one per side)
    met = Counter(t.rsplit(".", 1)[1] for t in {t for leg in walked.values() for t in leg["types"]})
    assert named == met, f"named but not met: {named - met}; met but not named: {met - named}"
