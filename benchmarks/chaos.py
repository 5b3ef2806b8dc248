"""A seeded fault campaign against three real daemons, an S3 endpoint behind a fault proxy and a training rank.

    .venv/bin/python benchmarks/chaos.py --faults 30 --seed 1

The system (chaos_cluster.py): node a, which the rank saves to, with its NVMe root on
a small tmpfs; nodes b and c, a's peers, one of them keeping a replica of every step
(the other standing in for it once it fails for [peer] failover_s); moto's S3 server,
which a reaches through a proxy that can fail; the rank, saving a state known from its
step and printing the tiers each step reached. Between faults the rank runs a random
while; then one fault of those in chaos_faults.py: kill -9 of the daemon, the rank,
both, the daemon again in its start-up recovery, the peer, a restore; a peer that stops
answering; a full disk; a store that answers 5xx, resets or stalls; a bit flipped or a
file cut short in a checksummed slot, an NVMe copy, a replica or an object; a peer down for long
(--peer-down-s: every step saved meanwhile must have a replica on a live node within
failover_s + 10 s); a flood of idle connections on a peer's data port; a peer out of
file descriptors. Where network namespaces can be made (root, iproute2), the nodes and the
store's proxy are hosts of their own behind a router (tests/netns.py), and the network faults
of chaos_network.py join them: a node cut off both ways while it saves and serves loads, a
one-way cut, partitions 1|2 and 2|1, the store cut off, a flapping link, a slow link; each
heals after --cut-s. Elsewhere those kinds are skipped, and the table says so.

After each fault it waits until a new step reaches the tier the fault hit (the time to
serve again), pauses the rank and checks, then lets it go on:
- every step that must load does, bit for bit (else: lost). A step must load when it
  was reported durable on a tier whose copy was left alone and which [retention] still
  keeps it on: every step in the store, the newest ones on NVMe and on the peer;
- no load returns other bytes than saved (else: wrong bytes); any step may be loaded,
  and an error is the right answer for one whose copies were damaged or retired;
- every listed step is whole on each tier it is listed on: its commit record and its shard's
  files (else: partial visible);
- after a heal, every shard is on its placed peer again within HEALED_WITHIN_S (timed: median
  and max per kind), and after every fault a new step reaches the tier it hit (else: stuck).
It prints a table per kind of fault and writes JSON, also when stopped early (SIGINT, SIGTERM,
--time-limit-s, or an error of its own). It is not a test; tests/e2e/test_chaos.py runs a
short campaign.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import ckpt
import torch
from chaos_cluster import JOB, RETENTION, TIERS, Cluster
from chaos_faults import KINDS, PEER_DOWN_S, inject
from chaos_network import CUT_S, HEALED_WITHIN_S, NETWORK_KINDS, inject_network
from chaos_rank import state_for
from ckpt_core.format import COMMIT_NAME, data_name, meta_name
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from netns import NamespacesRefused, Network

NEWEST = 3  # after each fault: the newest steps reported on each tier ...
SAMPLE = 3  # ... and a sample of older ones
FINAL_NEWEST = 50  # at the end: the newest steps, every step that must load, and a sample of the rest
FINAL_SAMPLE = 300
RECOVER_TIMEOUT_S = 120.0  # a store's retries back off up to 30 s
BAD = ("lost", "wrong bytes", "partial visible", "not serving again")
FAILOVER_BAD = ("not replicated within the bound", "not fully replicated after the return")  # peer-down's own
NETWORK_BAD = ("saves stopped during the cut", "replicated after the heal, past the bound")  # chaos_network's
STUCK = ("not serving again", "not fully replicated after the return", "not fully replicated after the heal")


def must_load(cluster: Cluster, damaged: dict[int, set[str]]) -> set[int]:
    """Return the steps that must load now: reported durable on a tier that keeps them, copy left alone.

    Call with the rank paused or killed: no newer step can then push one out of retention.
    A step in flight may be complete without being reported: hence the margin of 2.
    """
    horizon = cluster.rank.newest_attempted + 2
    must = set()
    for tier in TIERS:
        for step in cluster.rank.steps(tier):
            if tier not in damaged.get(step, set()) and (RETENTION[tier] == 0 or horizon - step < RETENTION[tier]):
                must.add(step)
    return must


def check(cluster: Cluster, steps: list[int], must: set[int], after: str) -> Counter[str]:
    """Load each step through node a and compare; check every listed step's commit record (after: the fault)."""
    found: Counter[str] = Counter()
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(cluster.a.socket_path)) as c:
        for step in steps:
            try:
                got = c.load(step)
            except ckpt.CheckpointError as e:
                found["lost" if step in must else "refused (damaged or retired)"] += 1
                if step in must:
                    print(f"lost after {after}: step {step}: {e}", flush=True)
                continue
            found["checked"] += 1
            if got["step"] != step or not torch.equal(got["w"], state_for(step)["w"]):
                found["wrong bytes"] += 1
                print(f"wrong bytes after {after}: step {step}", flush=True)
    found["partial visible"] += len(_partial(cluster))
    return found


def _listed(cluster: Cluster) -> set[tuple[int, str]]:
    client = cluster.a.client()
    try:
        return {(s.step, t) for s in client.call("List", pb.ListRequest(job=JOB)).steps for t in s.tiers}
    finally:
        client.close()


def _partial(cluster: Cluster) -> set[tuple[int, str]]:
    """Return the (step, tier) listed while the tier did not hold the step whole, before the listing nor after.

    A listing takes a while (it asks the peer and the store) and retention goes on meanwhile:
    a step whole just before the listing and gone just after it was retired, not partial.
    The store keeps every step, so there a step must be whole after the listing.
    """
    before = {tier: _whole_steps(cluster, tier) for tier in ("nvme", "peer")}
    partial = set()
    for step, tier in _listed(cluster):
        if tier == "memory" or step in before.get(tier, set()) or _is_whole(cluster, step, tier):
            continue
        partial.add((step, tier))
        print(f"partial visible: step {step} listed on {tier}, which does not hold it whole", flush=True)
        print(f"  what each node holds of step {step} now: {_files_of(cluster, step)}", flush=True)
    return partial


def _files_of(cluster: Cluster, step: int) -> str:
    """Say which files of a step each place holds now (a's NVMe and replica store, b's and c's replica stores)."""
    places = [cluster.nvme_dir(step), cluster.a.root / ".peer" / JOB / str(step), *cluster.replica_dirs(step)]
    return "; ".join(f"{p}: {sorted(q.name for q in p.iterdir()) if p.is_dir() else 'none'}" for p in places)


def _whole_steps(cluster: Cluster, tier: str) -> set[int]:
    """Return the steps node a's NVMe, or b's and c's replica stores, hold whole now."""
    places = [cluster.nvme_dir(0).parent] if tier == "nvme" else [d.parent for d in cluster.replica_dirs(0)]
    names = {p.name for where in places if where.is_dir() for p in where.iterdir()}
    return {int(n) for n in names if n.isdigit() and _is_whole(cluster, int(n), tier)}


def _is_whole(cluster: Cluster, step: int, tier: str) -> bool:
    """Say whether a tier holds what listing the step there claims: the commit record, or on the peer the shard.

    A step complete on the peer tier is one whose every rank has a replica on a peer; the
    commit record may be only on the node that saved it (docs/FORMAT.md, steps spread over nodes).
    """
    if tier == "nvme":
        return all((cluster.nvme_dir(step) / name).exists() for name in (COMMIT_NAME, data_name(0), meta_name(0)))
    if tier == "peer":  # on b or on c: the placed peer, or its stand-in
        names = (data_name(0), meta_name(0))
        return any(all((where / name).exists() for name in names) for where in cluster.replica_dirs(step))
    if tier == "object":  # the shards lie elsewhere (hashed keys, docs/FORMAT.md): loading checks their bytes
        return any(k.endswith("/" + COMMIT_NAME) for k in cluster.object_keys(step))
    return True  # memory: a slot holds one rank's shard, and is listed only once its copy committed


def kinds_here(cluster: Cluster) -> tuple[str, ...]:
    """Return the kinds of fault a campaign on cluster injects: the network's only where its nodes are hosts."""
    return KINDS + NETWORK_KINDS if cluster.network is not None else KINDS


def campaign(
    faults: int,
    seed: int,
    cluster: Cluster,
    peer_down_s: float = PEER_DOWN_S,
    stop: threading.Event | None = None,
    cut_s: float = CUT_S,
    table: dict[str, Counter[str]] | None = None,
) -> dict[str, Counter[str]]:
    """Run the campaign; return, per kind of fault, its counts (times in the keys ending in _s).

    Once `stop` is set (main's SIGTERM handler, its time limit) no further fault is injected: the
    campaign goes straight to its final check, so that a stopped campaign still has a table. The
    counts go into `table` as they come (main's: printed even if the campaign raises)."""
    stop = stop or threading.Event()
    started = time.monotonic()
    rng = random.Random(seed)
    table = table if table is not None else defaultdict(Counter)
    kinds = kinds_here(cluster)
    ready: dict[str, list[float]] = defaultdict(list)
    recovered: dict[str, list[float]] = defaultdict(list)
    measured: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # kind -> key -> times
    damaged: dict[int, set[str]] = {}
    cluster.start()
    injected = attempts = 0
    while injected < faults and attempts < 3 * faults and not stop.is_set():  # a fault not possible yet: again
        attempts += 1
        time.sleep(rng.uniform(0.05, 0.5))  # a random moment of the rank's saves: the point of a campaign
        kind = kinds[(attempts - 1) % len(kinds)] if attempts <= len(kinds) else rng.choice(kinds)
        failed_saves = cluster.rank.failed_saves
        restorable = sorted(s for s in cluster.rank.steps("object") if "object" not in damaged.get(s, set()))
        if kind in NETWORK_KINDS:
            fault = inject_network(kind, rng, cluster, cut_s)
        else:
            fault = inject(kind, rng, cluster, restorable, peer_down_s)
        if fault is None:
            table[kind]["not possible yet"] += 1
            continue
        injected += 1
        table[kind]["injected"] += 1
        table[kind] += fault.found
        for step, tiers in fault.damaged.items():
            damaged.setdefault(step, set()).update(tiers)
        if fault.serve_again_s is not None:
            ready[kind].append(fault.serve_again_s)
        for key, seconds in fault.times.items():
            measured[kind][key].append(seconds)
        when = cluster.rank.wait_report(fault.awaits, fault.ended_at, RECOVER_TIMEOUT_S)
        if when is None:
            table[kind]["not serving again"] += 1
            print(f"{kind}: no step reached {fault.awaits} in {RECOVER_TIMEOUT_S} s after the fault", flush=True)
        else:
            recovered[kind].append(when - fault.ended_at)
        table[kind]["saves failed"] += cluster.rank.failed_saves - failed_saves
        cluster.rank.pause()
        try:
            must = must_load(cluster, damaged)
            table[kind] += check(cluster, _sample(rng, cluster, set(fault.damaged), NEWEST, SAMPLE), must, kind)
        finally:
            cluster.rank.resume()
        print(f"[{time.monotonic() - started:.0f} s] fault {injected}/{faults} ({kind}) checked", flush=True)
    cluster.rank.kill()
    must = must_load(cluster, damaged)
    final = sorted(must | set(_sample(rng, cluster, set(), FINAL_NEWEST, FINAL_SAMPLE)))
    table["final"] += check(cluster, final, must, "the campaign")
    _times_into(table, ready, recovered, measured)
    return table


def _times_into(
    table: dict[str, Counter[str]],
    ready: dict[str, list[float]],
    recovered: dict[str, list[float]],
    measured: dict[str, dict[str, list[float]]],
) -> None:
    """Put each kind's times into its counts: max, median (keys ending in _s_max, _s_median)."""
    for kind in list(table):
        if ready[kind]:
            table[kind]["ready_s_max"] = round(max(ready[kind]), 3)
        if recovered[kind]:
            table[kind]["next_durable_s_median"] = round(statistics.median(recovered[kind]), 3)
            table[kind]["next_durable_s_max"] = round(max(recovered[kind]), 3)
        for key, times in measured[kind].items():  # the fault's own: e.g. fully_replicated_s, after a peer-down
            table[kind][key.removesuffix("_s") + "_s_median"] = round(statistics.median(times), 3)
            table[kind][key.removesuffix("_s") + "_s_max"] = round(max(times), 3)


def _sample(rng: random.Random, cluster: Cluster, touched: set[int], newest: int, sample: int) -> list[int]:
    """Return the steps to load: the newest reported on each tier, the touched ones, a sample of the rest."""
    steps = set(touched)
    every: set[int] = set()
    for tier in TIERS:
        reported = sorted(cluster.rank.steps(tier))
        steps.update(reported[-newest:])
        every.update(reported)
    rest = sorted(every - steps)
    return sorted(steps | set(rng.sample(rest, min(sample, len(rest)))))


COLUMNS = (
    "injected",
    "checked",
    "lost",
    "wrong bytes",
    "partial visible",
    "stuck",
    "refused (damaged or retired)",
    "ready_s_max",
    "next_durable_s_median",
    "replicated_after_heal_s_median",
    "replicated_after_heal_s_max",
)


def print_table(table: dict[str, Counter[str]]) -> None:
    """Print a row per kind (stuck: not serving again, or replicas never back), then each kind's other counts."""
    rows = {kind: counts + Counter({"stuck": sum(counts.get(c, 0) for c in STUCK)}) for kind, counts in table.items()}
    print(f"{'fault':<14}" + "".join(f"{c:>{max(9, len(c) + 2)}}" for c in COLUMNS))
    for kind, counts in rows.items():
        cells = (counts.get(c, "" if "_s_" in c else 0) for c in COLUMNS)  # a time not measured: blank
        print(f"{kind:<14}" + "".join(f"{cell:>{max(9, len(c) + 2)}}" for c, cell in zip(COLUMNS, cells, strict=True)))
    totals = sum(rows.values(), Counter())
    print(
        f"{'all':<14}" + "".join(f"{totals.get(c, 0) if '_s_' not in c else '':>{max(9, len(c) + 2)}}" for c in COLUMNS)
    )
    for kind, counts in table.items():
        more = {k: v for k, v in counts.items() if k not in COLUMNS}
        if more:
            print(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(more.items())))


def main() -> int:
    """Run a campaign, print its table, write JSON; exit 1 if anything was lost, wrong, partial or stuck,
    or a peer-down found a step without a replica on a live node in time, or replicas never back in place,
    or a network fault stopped the saves or left replicas short past HEALED_WITHIN_S."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=30, help="how many faults to inject (default 30)")
    p.add_argument("--seed", type=int, default=1, help="the campaign's seed (default 1)")
    p.add_argument(
        "--peer-down-s",
        type=float,
        default=PEER_DOWN_S,
        help=f"how long a peer-down fault keeps its peer down (default {PEER_DOWN_S:.0f})",
    )
    p.add_argument("--cut-s", type=float, default=CUT_S, help=f"how long a network cut lasts (default {CUT_S:.0f})")
    p.add_argument("--time-limit-s", type=float, help="stop injecting after this long: final check, then the table")
    p.add_argument("--no-network", action="store_true", help="every process on loopback: no network faults")
    p.add_argument("--json", type=Path, help="where to write the table as JSON")
    p.add_argument("--logs", type=Path, help="a directory to keep the logs of the daemons, the rank and moto in")
    args = p.parse_args()
    stop = threading.Event()
    _stop_gracefully_on(signal.SIGTERM, stop)
    _stop_gracefully_on(signal.SIGINT, stop)
    if args.time_limit_s is not None:
        limit = threading.Timer(args.time_limit_s, stop.set)
        limit.daemon = True  # a campaign done before its limit exits at once
        limit.start()
    network, no_network = None, "--no-network" if args.no_network else ""
    if not args.no_network:
        try:
            network = Network()
        except NamespacesRefused as e:
            no_network = str(e)
    work = Path(tempfile.mkdtemp(prefix="ckptd-chaos-"))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-chaos-", dir="/dev/shm"))
    started = time.monotonic()
    table: dict[str, Counter[str]] = defaultdict(Counter)
    cluster = Cluster(work, staging, network)
    try:
        campaign(args.faults, args.seed, cluster, args.peer_down_s, stop, args.cut_s, table)
    finally:
        cluster.stop()
        if network is not None:
            network.close()
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            logs = {f"{n.name}.log": n.log_path for n in (cluster.a, *cluster.peers)} | {"rank.log": work / "rank.log"}
            for name, log in {**logs, "moto.log": work / "moto.log"}.items():
                if log.exists():
                    shutil.copy(log, args.logs / name)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        _report(args, table, cluster, stop, no_network, time.monotonic() - started)
    return 1 if any(counts.get(c, 0) for counts in table.values() for c in (*BAD, *FAILOVER_BAD, *NETWORK_BAD)) else 0


def _report(
    args: argparse.Namespace,
    table: dict[str, Counter[str]],
    cluster: Cluster,
    stop: threading.Event,
    no_network: str,
    took_s: float,
) -> None:
    """Print the table and what the run was (also after an error), and write it as JSON if asked."""
    print_table(table)
    injected = sum(counts["injected"] for counts in table.values())
    if "final" not in table:
        print(f"ended by an error: {injected} of {args.faults} faults injected, no final check", flush=True)
    elif stop.is_set():
        print(f"stopped early: {injected} of {args.faults} faults injected", flush=True)
    elif injected < args.faults:
        print(f"{injected} of {args.faults} faults injected: the others were not possible in {3 * args.faults} tries")
    heals = [
        counts["replicated_after_heal_s_max"] for counts in table.values() if "replicated_after_heal_s_max" in counts
    ]
    if heals:
        print(f"time to full replication after a heal: max {max(heals):.1f} s over {len(heals)} network kinds", end="")
        print(f" (bound {HEALED_WITHIN_S:.0f} s; each kind's median and max in the table)")
    disk = "a tmpfs of its own" if cluster.disk.mounted else "a plain directory (no disk-full faults: mount refused)"
    print(f"seed {args.seed}, {args.faults} faults, {took_s:.0f} s; node a's root on {disk}")
    if no_network:
        print(f"network faults skipped ({', '.join(NETWORK_KINDS)}): {no_network}")
    if args.json:
        not_here = ([] if cluster.disk.mounted else ["disk-full"]) + (list(NETWORK_KINDS) if no_network else [])
        result = {"seed": args.seed, "faults": args.faults, "injected": injected, "peer_down_s": args.peer_down_s}
        result |= {"cut_s": args.cut_s, "stopped_early": stop.is_set(), "network_skipped": no_network}
        result["kinds"] = KINDS + NETWORK_KINDS
        result["kinds_not_possible_here"] = not_here
        args.json.write_text(json.dumps({**result, "table": table}, indent=1))


def _stop_gracefully_on(signum: signal.Signals, stop: threading.Event) -> None:
    """Make the first `signum` end the campaign after the fault under way, with its final check and table;
    a second one stops at once (cleaning up, without a table)."""

    def handler(*_: object) -> None:
        if stop.is_set():
            sys.exit(1)
        stop.set()
        said = f"{signum.name}: stopping after this fault, then the final check and the table; again to stop now\n"
        os.write(sys.stdout.fileno(), said.encode())  # not print: the main thread may be inside a print

    signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
