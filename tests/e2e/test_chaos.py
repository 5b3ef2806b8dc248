"""A short seeded fault campaign (benchmarks/chaos.py) in CI: 34 faults, every kind, nothing lost, wrong or stuck;
and the campaign's checker, shown to catch a broken promise planted behind a daemon's back.

peer-down keeps its peer down for PEER_DOWN_S instead of the full campaign's 60 s: long
enough for failover ([peer] failover_s = 2 s in the campaign) to place the replicas on the
other peer, and for the peer's return to take them back. A network cut lasts CUT_S instead
of 8 s: past failover_s, so that stand-ins take over and the heal gives the copies back.
Where network namespaces cannot be made, the campaign skips the network kinds and says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ckpt_core.format import COMMIT_NAME, data_name

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CHAOS = BENCHMARKS / "chaos.py"
FAULTS = 34  # each of the 27 kinds once, then 7 at random: about three minutes on a busy 2-core machine
PEER_DOWN_S = 6
CUT_S = 3
NETWORK_KINDS = ("isolate", "one-way", "partition-1|2", "partition-2|1", "store-cut", "flap", "slow-store")


@pytest.mark.timeout(540)
def test_a_short_campaign_loses_nothing_returns_no_wrong_byte_and_lists_nothing_partial(tmp_path):
    out = tmp_path / "chaos.json"
    args = ["--faults", str(FAULTS), "--seed", "3", "--peer-down-s", str(PEER_DOWN_S), "--cut-s", str(CUT_S)]
    logs = tmp_path / "logs"
    args += ["--json", str(out), "--logs", str(logs)]
    run = subprocess.run(
        [sys.executable, str(CHAOS), *args],
        capture_output=True,
        text=True,
        timeout=480,
    )
    kept = "".join(f"\n--- {p.name}, its end:\n{p.read_text(errors='replace')[-4000:]}" for p in logs.glob("*.log"))
    assert run.returncode == 0, run.stdout + run.stderr[-3000:] + kept
    print(run.stdout)
    result = json.loads(out.read_text())
    table = result["table"]
    kinds = set(result["kinds"]) - set(result["kinds_not_possible_here"])  # a full disk needs a mount, ...
    assert len(kinds) >= (19 if result["network_skipped"] else 26)  # ... the network kinds namespaces
    assert kinds <= {k for k, counts in table.items() if counts.get("injected", 0) >= 1}
    assert sum(counts.get("injected", 0) for counts in table.values()) == FAULTS
    assert table["final"]["checked"] >= 1
    assert sum(counts.get("checked", 0) for counts in table.values()) >= FAULTS  # loads compared bit for bit
    assert table["restore"]["checked"] >= 1  # a restore cut short, then done again and loaded
    for counts in table.values():
        assert [counts.get(c, 0) for c in ("lost", "wrong bytes", "partial visible", "not serving again")] == [0] * 4
    down = table["peer-down"]  # every step saved while a peer was down: a replica on a live node in time
    assert down.get("replicated on live nodes", 0) >= 1
    assert down.get("not replicated within the bound", 0) == down.get("not fully replicated after the return", 0) == 0
    assert "fully_replicated_s_max" in down  # the replicas back on the returned peer, stand-ins' copies retired
    assert table["data-flood"].get("flood connections", 0) >= 1
    if result["network_skipped"]:
        assert "network faults skipped" in run.stdout
        return
    for kind in NETWORK_KINDS:  # saves went on during each cut; every shard on its placed peer soon after the heal
        counts = table[kind]
        assert counts.get("saves stopped during the cut", 0) == 0, kind
        assert counts.get("not fully replicated after the heal", 0) == 0, kind
        assert counts.get("replicated after the heal, past the bound", 0) == 0, kind
        assert "replicated_after_heal_s_max" in counts, kind
    assert table["isolate"].get("loaded while cut off", 0) >= 1  # a cut-off node serves loads from its own tiers


@pytest.mark.timeout(180)
def test_the_checker_reports_a_shard_removed_behind_the_daemons_back_after_wait_returned(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import chaos
        from chaos_cluster import Cluster
    finally:
        sys.path.remove(str(BENCHMARKS))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-chaos-", dir="/dev/shm"))
    cluster = Cluster(tmp_path / "work", staging)
    try:
        cluster.start()
        assert cluster.rank.wait_report("nvme", 0.0, 60) is not None, "no step reached NVMe"
        cluster.rank.pause()
        step = max(s for s in cluster.rank.steps("nvme") if (cluster.nvme_dir(s) / COMMIT_NAME).exists())
        assert chaos.check(cluster, [step], {step}, "nothing")["partial visible"] == 0
        (cluster.nvme_dir(step) / data_name(0)).unlink()  # after wait("nvme") returned, behind the daemon's back
        found = chaos.check(cluster, [step], {step}, "a planted violation")
    finally:
        cluster.stop()
        shutil.rmtree(staging, ignore_errors=True)
    assert found["partial visible"] + found["lost"] >= 1, found


@pytest.mark.timeout(240)
def test_a_campaign_stopped_by_its_time_limit_still_checks_and_prints_its_table(tmp_path):
    out = tmp_path / "chaos.json"
    args = ["--faults", "1000", "--seed", "4", "--time-limit-s", "10", "--no-network", "--json", str(out)]
    run = subprocess.run([sys.executable, str(CHAOS), *args], capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "stopped early:" in run.stdout and "faults injected" in run.stdout
    assert "network faults skipped" in run.stdout  # --no-network: the table says the network kinds did not run
    result = json.loads(out.read_text())
    assert result["stopped_early"] and 1 <= result["injected"] < 1000
    assert result["table"]["final"]["checked"] >= 1  # the final check ran before the table
    header = next(line for line in run.stdout.splitlines() if line.startswith("fault "))
    for column in ("injected", "checked", "lost", "wrong bytes", "partial visible", "stuck"):
        assert column in header
