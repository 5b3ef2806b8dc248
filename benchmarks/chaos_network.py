"""The network faults of a campaign, on a cluster whose nodes are hosts (chaos_cluster.py, tests/netns.py).

chaos.py calls inject_network(kind, ...) between two checks, as it calls chaos_faults.inject
for the other kinds. Each fault cuts links in the router while the rank saves, for cut_s
(--cut-s), then heals every cut and measures the time until node a has every shard on its
placed peer again (a's under_replicated: no shard short, none on a stand-in), which must be
within HEALED_WITHIN_S. The kinds:

    isolate        a cut off both ways from b, c and the store while it saves; while cut off,
                   a serves loads of its newest steps from its own tiers (bit for bit)
    one-way        what a's placed peer sends a is dropped: a's requests arrive, no answer returns
    partition-1|2  {a} | {b, c} during seals (the store stays reachable)
    partition-2|1  {a, the other peer} | {the placed peer}: a stand-in on a's side
    store-cut      a and the store's host cut apart both ways
    flap           a's link to its placed peer cut and healed FLAPS times, for FLAP_S each way
    slow-store     the store's proxy relays SLOW_BLOCK_S late per block (fault_proxy.py)

During each, the side with the trainer keeps saving: at least one step must reach NVMe while the
cut lasts (else `saves stopped during the cut`). None when the cluster is not on a network.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import ckpt
import torch
from chaos_cluster import JOB, Cluster
from chaos_faults import Fault, under_replicated
from chaos_rank import state_for
from ckpt_core.format import COMMIT_NAME

NETWORK_KINDS = ("isolate", "one-way", "partition-1|2", "partition-2|1", "store-cut", "flap", "slow-store")
CUT_S = 8.0  # how long a cut lasts before it heals (chaos.py --cut-s)
FLAPS = 4
FLAP_S = (0.3, 1.5)  # flap: how long each cut, and each heal between, lasts
HEALED_WITHIN_S = 30.0  # after a heal, every shard on its placed peer by then (stated in docs/OPERATIONS.md)
HEALED_TIMEOUT_S = 120.0  # ... and followed this long before it counts as stuck
LOADED_WHILE_CUT = 2  # isolate: the newest steps on a's NVMe loaded while it is cut off
POLL_S = 0.25


def inject_network(kind: str, rng: random.Random, cluster: Cluster, cut_s: float = CUT_S) -> Fault | None:
    """Cut links as kind says, for cut_s, then heal; return what the fault found and measured."""
    network = cluster.network
    if network is None:
        return None
    a, store = cluster.hosts["a"], cluster.hosts["store"]
    placed = cluster.placed_peer()
    other = next(p for p in cluster.peers if p is not placed)
    fault = Fault(kind, awaits="object" if kind in ("store-cut", "slow-store") else "peer")
    started = time.monotonic()
    if kind == "flap":
        for _ in range(FLAPS):
            network.cut(a, cluster.host(placed))
            time.sleep(rng.uniform(*FLAP_S))  # the flap's rhythm is the fault
            network.heal()
            time.sleep(rng.uniform(*FLAP_S))
    else:
        if kind == "isolate":
            network.isolate(a)
        elif kind == "one-way":
            network.cut_one_way(cluster.host(placed), a)
        elif kind == "partition-1|2":
            network.partition([a], [cluster.host(p) for p in cluster.peers])
        elif kind == "partition-2|1":
            network.partition([a, cluster.host(other)], [cluster.host(placed)])
        elif kind == "store-cut":
            network.cut(a, store)
        elif kind == "slow-store":
            assert cluster.proxy is not None
            cluster.proxy.set_mode("slow")
        else:
            raise ValueError(f"unknown network fault {kind!r}")
        time.sleep(cut_s / 2)  # the cut's length is the fault
        if kind == "isolate":
            fault.found += _loads_while_cut(cluster)
        time.sleep(max(0.0, started + cut_s - time.monotonic()))
        network.heal()
        if cluster.proxy is not None:
            cluster.proxy.set_mode("pass")
    healed_at = time.monotonic()
    if not any(started <= at < healed_at for at in cluster.rank.steps("nvme").values()):
        fault.found["saves stopped during the cut"] += 1
        print(f"{kind}: no step reached NVMe in the {healed_at - started:.1f} s of the cut", flush=True)
    _replicated_after_heal(cluster, fault, healed_at)
    fault.ended_at = time.monotonic()
    return fault


def _loads_while_cut(cluster: Cluster) -> Counter[str]:
    """Load the newest steps whole on a's NVMe through a, cut off as it is; count checked, lost and wrong bytes.

    The rank is paused meanwhile, so that retention keeps what is loaded.
    """
    found: Counter[str] = Counter()
    cluster.rank.pause()
    try:
        steps = sorted(s for s in cluster.rank.steps("nvme") if (cluster.nvme_dir(s) / COMMIT_NAME).exists())
        with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(cluster.a.socket_path)) as c:
            for step in steps[-LOADED_WHILE_CUT:]:
                try:
                    got = c.load(step)
                except ckpt.CheckpointError as e:
                    found["lost"] += 1
                    print(f"lost while cut off: step {step}: {e}", flush=True)
                    continue
                found["loaded while cut off"] += 1
                found["checked"] += 1
                if got["step"] != step or not torch.equal(got["w"], state_for(step)["w"]):
                    found["wrong bytes"] += 1
                    print(f"wrong bytes while cut off: step {step}", flush=True)
    finally:
        cluster.rank.resume()
    return found


def _replicated_after_heal(cluster: Cluster, fault: Fault, healed_at: float) -> None:
    """Follow a's under_replicated after a heal until no shard is short or on a stand-in; time it into fault."""
    while time.monotonic() < healed_at + HEALED_TIMEOUT_S:
        short = under_replicated(cluster)
        if short is not None and short["shards"] == 0 and short["on_stand_in"] == 0:
            took = time.monotonic() - healed_at
            fault.times["replicated_after_heal_s"] = round(took, 3)
            if took > HEALED_WITHIN_S:
                fault.found["replicated after the heal, past the bound"] += 1
            return
        time.sleep(POLL_S)
    fault.found["not fully replicated after the heal"] += 1
    print(f"{fault.kind}: a still short of replicas {HEALED_TIMEOUT_S:.0f} s after the heal", flush=True)
