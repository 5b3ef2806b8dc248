"""The faults of a campaign, one function per kind: chaos.py calls inject(kind, ...) between two checks.

Each returns a Fault: the copies it damaged (step -> tiers), the tier on which a new
step must be reported before the system counts as serving again, and what it measured
on the way (how long a killed node took to answer, what a killed daemon was doing,
what a killed restore left, how soon the steps saved while a peer was down had their
replica on a live node). None when there was nothing to damage yet.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import ckpt
import torch
from chaos_cluster import FAILOVER_S, JOB, RETENTION, Cluster
from chaos_rank import state_for
from ckpt_core.format import COMMIT_NAME, ShardMeta, data_name, meta_name
from daemon import BenchDaemon, daemon_env

KINDS = (
    "daemon",
    "rank",
    "both",
    "startup",
    "peer",
    "peer-stall",
    "restore",
    "disk-full",
    "object-5xx",
    "object-reset",
    "object-stall",
    "flip-data",
    "flip-record",
    "truncate",
    "flip-slot",
    "flip-replica",
    "flip-object",
    "peer-down",
    "data-flood",
    "fd-exhaustion",
)
OUTAGE_S = (0.5, 3.0)  # how long a store, a peer or a disk stays broken
PEER_DOWN_S = 60.0  # how long a peer-down keeps its peer down (chaos.py --peer-down-s)
REPLICATED_WITHIN_S = FAILOVER_S + 10.0  # a step saved while a peer is down has its replica on a live node by then
FULLY_REPLICATED_TIMEOUT_S = 120.0  # after a peer-down's peer returns: every shard on its placed peer by then
POLL_S = 0.1
FLOOD_CONNECTIONS = 64
FLOOD_WAIT_S = 5.0  # data-flood: for a's next range to the peer, to say which way replicas go before it
FD_HEADROOM = 2  # fd-exhaustion: the descriptors a peer may still open
STARTUP_KILL_S = (0.0, 0.6)  # when, after its launch, a daemon is killed in its start-up
RESTORE_TIMEOUT_S = 120.0


@dataclass
class Fault:
    """What one injected fault did, for the campaign's checks and table."""

    kind: str
    damaged: dict[int, set[str]] = field(default_factory=dict)  # step -> tiers whose copy was damaged
    awaits: str = "nvme"  # a step must reach this tier after the fault before the system serves again
    ended_at: float = field(default_factory=time.monotonic)
    serve_again_s: float | None = None  # measured by the fault itself (a restart, a restore)
    found: Counter[str] = field(default_factory=Counter)  # counts the fault checked itself
    times: dict[str, float] = field(default_factory=dict)  # seconds it measured: the table gives max and median


def inject(
    kind: str, rng: random.Random, cluster: Cluster, must_load: list[int], peer_down_s: float = PEER_DOWN_S
) -> Fault | None:
    """Inject one fault of kind; return what it did, or None if it found nothing to damage."""
    if kind in ("daemon", "rank", "both", "startup"):
        return _kill(kind, rng, cluster)
    if kind == "peer":
        cluster.b.kill()
        return Fault(kind, awaits="peer", serve_again_s=cluster.restart(cluster.b))
    if kind == "peer-stall":  # the port still accepts; nothing behind it answers
        assert cluster.b.proc is not None
        os.kill(cluster.b.proc.pid, signal.SIGSTOP)
        time.sleep(rng.uniform(*OUTAGE_S))  # the outage's length is the fault
        os.kill(cluster.b.proc.pid, signal.SIGCONT)
        return Fault(kind, awaits="peer")
    if kind == "peer-down":
        return _peer_down(rng, cluster, peer_down_s)
    if kind == "data-flood":
        return _data_flood(rng, cluster)
    if kind == "fd-exhaustion":
        return _fd_exhaustion(rng, cluster)
    if kind == "disk-full":
        if not cluster.disk.mounted:
            return None
        cluster.disk.fill()
        time.sleep(rng.uniform(*OUTAGE_S))
        cluster.disk.free()
        return Fault(kind)
    if kind.startswith("object-"):
        assert cluster.proxy is not None
        answered, reset = cluster.proxy.answered_5xx, cluster.proxy.reset_connections
        cluster.proxy.set_mode(kind.removeprefix("object-"))
        time.sleep(rng.uniform(*OUTAGE_S))
        cluster.proxy.set_mode("pass")
        fault = Fault(kind, awaits="object")
        fault.found["store answers 503"] = cluster.proxy.answered_5xx - answered
        fault.found["store connections reset"] = cluster.proxy.reset_connections - reset
        return fault
    if kind == "restore":
        return _restore(rng, cluster, must_load) if must_load else None
    return _damage(kind, rng, cluster)


def activity(cluster: Cluster) -> Counter[str]:
    """Return what node a has under way: flushes, replicas and uploads (from its status)."""
    try:
        status = cluster.a.status()
    except Exception:  # a node that does not answer is doing nothing we can name
        return Counter()
    peers = status["tiers"]["peer"].get("peers", {}).values()
    store = status["tiers"]["object"]
    return Counter(
        {
            "during flush": int(status["staging"]["pending_flushes"] > 0),
            "during replication": int(sum(p["pending_replicas"] for p in peers) > 0),
            "during upload": int(store.get("uploading", 0) + store.get("pending_uploads", 0) > 0),
        }
    )


def _kill(kind: str, rng: random.Random, cluster: Cluster) -> Fault:
    fault = Fault(kind)
    if kind != "rank":
        fault.found += activity(cluster)
        cluster.a.kill()
    if kind in ("rank", "both"):
        cluster.rank.kill()
    if kind == "startup":  # killed again while it recovers what the first kill left
        (cluster.a.work / "notify.sock").unlink(missing_ok=True)
        cluster.a.launch().close()
        time.sleep(rng.uniform(*STARTUP_KILL_S))  # a random moment of the start-up is the fault
        cluster.a.kill()
    if kind != "rank":
        fault.serve_again_s = cluster.restart(cluster.a)
    if kind in ("rank", "both"):
        cluster.rank.start()
    return fault


class _ReplicaWatch:
    """Follow the steps that reached a's NVMe while a peer was down, until each has a replica on a live node.

    A step's verdict: `replicated on live nodes` within REPLICATED_WITHIN_S of its report (the
    replica's data and shard record on a node that is up: the placed peer, or its stand-in),
    `replicated late`, `retired past the peer keep` (a's [retention] dropped it once RETENTION["peer"]
    newer steps were on NVMe: no replica of it is due), `retired before replicated` (dropped within
    that keep with no replica: what DESIGN guarantee 8 rules out), or `not replicated within the bound`.
    """

    def __init__(self, cluster: Cluster, since: float) -> None:
        self.cluster = cluster
        self.since = since
        self.until: float | None = None  # the peer's return: steps reported later are not followed
        self.reported: dict[int, float] = {}  # step -> when it reached NVMe
        self.verdicts: dict[int, str] = {}
        self.latencies: list[float] = []

    def poll(self, live: list[BenchDaemon]) -> None:
        now = time.monotonic()
        for step, at in self.cluster.rank.steps("nvme").items():
            if at >= self.since and (self.until is None or at < self.until):
                self.reported.setdefault(step, at)
        for step, at in self.reported.items():
            if step in self.verdicts:
                continue
            if any(_holds_replica(node, step) for node in live):
                in_time = now - at <= REPLICATED_WITHIN_S
                self.verdicts[step] = "replicated on live nodes" if in_time else "replicated late"
                self.latencies.append(now - at)
            elif not (self.cluster.nvme_dir(step) / COMMIT_NAME).exists():
                newer = sum(1 for s in self.cluster.rank.steps("nvme") if s > step)
                within_keep = newer < RETENTION["peer"]
                self.verdicts[step] = "retired before replicated" if within_keep else "retired past the peer keep"
                if within_keep:
                    print(f"peer-down: step {step} left NVMe with no replica, {newer} newer steps", flush=True)
            elif now - at > REPLICATED_WITHIN_S:
                self.verdicts[step] = "not replicated within the bound"
                print(f"peer-down: step {step} has no replica on a live node {now - at:.1f} s after it", flush=True)

    @property
    def undecided(self) -> bool:
        return len(self.verdicts) < len(self.reported)


def _holds_replica(node: BenchDaemon, step: int) -> bool:
    where = node.root / ".peer" / JOB / str(step)
    return (
        node.proc is not None
        and node.proc.poll() is None
        and all((where / name).exists() for name in (data_name(0), meta_name(0)))
    )


def under_replicated(cluster: Cluster) -> dict[str, float] | None:
    """Return node a's tiers.peer.under_replicated (shards, oldest_s, on_stand_in), or None if it did not answer."""
    try:
        return cluster.a.status()["tiers"]["peer"]["under_replicated"]
    except Exception:  # a node that does not answer says nothing
        return None


def _peer_down(rng: random.Random, cluster: Cluster, outage_s: float) -> Fault:
    """Kill b or c (the rng chooses; the campaign's first peer-down, the placed peer: failover, for sure) and keep
    it down for outage_s while the rank saves; start it again.

    Checks that every step saved meanwhile has a replica on a live node within
    REPLICATED_WITHIN_S (failover: a stand-in keeps the copies of a placed peer that fails),
    and measures, after the return, the time until every shard is on its placed peer again
    (a's under_replicated: no shard short, none on a stand-in: their copies retired).
    """
    victim = rng.choice(cluster.peers)
    if not cluster.peer_downs:
        victim = cluster.placed_peer()
    cluster.peer_downs += 1
    live = [p for p in cluster.peers if p is not victim]
    fault = Fault("peer-down", awaits="peer")
    fault.found["placed peer down" if victim is cluster.placed_peer() else "other peer down"] += 1
    victim.kill()
    down_at = time.monotonic()
    watch = _ReplicaWatch(cluster, down_at)
    next_status = down_at
    oldest_s = 0.0
    while time.monotonic() < down_at + outage_s:
        watch.poll(live)
        if time.monotonic() >= next_status:
            short = under_replicated(cluster)
            if short is not None:
                oldest_s = max(oldest_s, short["oldest_s"])
                if short["shards"] == 0 and short["on_stand_in"] > 0 and "replicated_by_stand_in_s" not in fault.times:
                    fault.times["replicated_by_stand_in_s"] = round(time.monotonic() - down_at, 3)
            next_status = time.monotonic() + 0.5
        time.sleep(POLL_S)
    fault.times["under_replicated_oldest_s"] = oldest_s
    watch.until = time.monotonic()
    fault.serve_again_s = cluster.restart(victim)
    back_at = time.monotonic()
    while watch.undecided:  # steps whose bound runs past the return: every node is live now
        watch.poll(list(cluster.peers))
        time.sleep(POLL_S)
    fault.found.update(Counter(watch.verdicts.values()))
    if watch.latencies:
        fault.times["replica_on_live_node_s"] = round(max(watch.latencies), 3)
    while time.monotonic() < back_at + FULLY_REPLICATED_TIMEOUT_S:
        short = under_replicated(cluster)
        if short is not None and short["shards"] == 0 and short["on_stand_in"] == 0:
            fault.times["fully_replicated_s"] = round(time.monotonic() - back_at, 3)
            break
        time.sleep(0.25)
    else:
        fault.found["not fully replicated after the return"] += 1
        print(f"peer-down: a still short of replicas {FULLY_REPLICATED_TIMEOUT_S} s after the return", flush=True)
    fault.ended_at = time.monotonic()
    return fault


def _peer_reports(cluster: Cluster, since: float) -> int:
    return sum(1 for at in cluster.rank.steps("peer").values() if at >= since)


def _ranges_sent(cluster: Cluster, peer: BenchDaemon) -> Counter[str]:
    """Return the ranges a has sent the peer so far, by way (data_channel, grpc_stream), from a's status."""
    try:
        return Counter(cluster.a.status()["tiers"]["peer"]["peers"][peer.listen]["ranges_sent"])
    except Exception:  # a node that does not answer says nothing
        return Counter()


def _way_in_use(cluster: Cluster, peer: BenchDaemon, fault: Fault) -> Counter[str]:
    """Wait (FLOOD_WAIT_S at most) for a's next range to the peer; count which way it went; return the ranges sent.

    a sends by gRPC for a while after a data connection failed (after a peer fault, say): a flood
    then meets the data listener alone, not the replicas' path.
    """
    before = _ranges_sent(cluster, peer)
    deadline = time.monotonic() + FLOOD_WAIT_S
    while time.monotonic() < deadline:
        now = _ranges_sent(cluster, peer)
        if now != before:
            way = "data channel" if now["data_channel"] > before["data_channel"] else "grpc stream"
            fault.found[f"replicas by {way} before the flood"] += 1
            return now
        time.sleep(POLL_S)
    return before


def _ranges_during(before: Counter[str], after: Counter[str], what: str) -> Counter[str]:
    return Counter({f"ranges by {way.replace('_', ' ')} {what}": after[way] - before[way] for way in after})


def _data_flood(rng: random.Random, cluster: Cluster) -> Fault | None:
    """Open FLOOD_CONNECTIONS connections to the placed peer's data port, half silent, half trickling a byte now
    and then; hold them for a while as the rank saves, then close them. None if the peer has no data channel."""
    target = cluster.placed_peer()
    try:
        port = target.status()["tiers"]["peer"]["data_port"]
    except Exception:
        return None
    if not port:
        return None
    fault = Fault("data-flood", awaits="peer")
    host = target.listen.rsplit(":", 1)[0]
    connections: list[socket.socket] = []
    ranges = _way_in_use(cluster, target, fault)
    started = time.monotonic()

    def connect() -> None:  # from where a is: on a network, its host
        for _ in range(FLOOD_CONNECTIONS):
            try:
                connections.append(socket.create_connection((host, port), timeout=2.0))
            except OSError:
                fault.found["flood connections refused"] += 1

    try:
        cluster.from_a(connect)
        fault.found["flood connections"] += len(connections)
        end = time.monotonic() + rng.uniform(*OUTAGE_S)
        while time.monotonic() < end:
            for conn in connections[::2]:  # the other half says nothing at all
                with contextlib.suppress(OSError):  # the listener closed it: its answer to junk
                    conn.send(b"\0")
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    finally:
        for conn in connections:
            conn.close()
    fault.found["steps on the peer during the flood"] += _peer_reports(cluster, started)
    fault.found += _ranges_during(ranges, _ranges_sent(cluster, target), "during the flood")
    fault.ended_at = time.monotonic()
    return fault


def _fd_exhaustion(rng: random.Random, cluster: Cluster) -> Fault:
    """Lower the placed peer's RLIMIT_NOFILE to FD_HEADROOM above the descriptors it has open, for a while as the
    rank saves; then restore it. The peer must live through it (else: counted as not serving again, restarted)."""
    target = cluster.placed_peer()
    assert target.proc is not None
    pid = target.proc.pid
    fault = Fault("fd-exhaustion", awaits="peer")
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    ranges = _ranges_sent(cluster, target)
    started = time.monotonic()
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + FD_HEADROOM, old[1]))
        time.sleep(rng.uniform(*OUTAGE_S))
        fault.found += _ranges_during(ranges, _ranges_sent(cluster, target), "while short of fds")
    finally:
        with contextlib.suppress(ProcessLookupError):  # it died of it: counted below
            resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
    fault.found["steps on the peer while short of fds"] += _peer_reports(cluster, started)
    if target.proc.poll() is not None:
        fault.found["not serving again"] += 1
        print(f"fd-exhaustion: {target.name} exited with {target.proc.returncode}:\n{target.log()}", flush=True)
        cluster.restart(target)
    fault.ended_at = time.monotonic()
    return fault


def _restore(rng: random.Random, cluster: Cluster, must_load: list[int]) -> Fault:
    """Kill a `ckptd restore`, or the daemon beside it, at a random moment; check what is left, restore again.

    A killed restore leaves nothing that loads with other bytes, and restoring again to
    the same place succeeds. A restore whose daemon was killed finishes: it needs none.
    """
    fault = Fault("restore")
    step = rng.choice(must_load)
    step_dir = cluster.work / "restored" / JOB / str(step)
    command = [
        *cluster.a.wrapper,
        sys.executable,
        "-m",
        "ckptd",
        "restore",
        "--config",
        str(cluster.a.work / "ckptd.toml"),
    ]
    command += ["--job", JOB, "--step", str(step), "--to", str(cluster.work / "restored")]
    log_path = cluster.work / "restore.log"
    with open(log_path, "wb") as log:
        started = time.monotonic()
        run = subprocess.Popen(command, env=daemon_env(), cwd=cluster.work, stdout=log, stderr=log)
        victim = rng.choice(("restore", "daemon"))
        try:
            run.wait(timeout=rng.uniform(0.0, 1.5))  # a random moment of the restore is the fault
            victim = "nothing (it was done)"
        except subprocess.TimeoutExpired:
            if victim == "daemon":
                cluster.a.kill()
                cluster.restart(cluster.a)
            else:
                run.kill()
        returncode = run.wait(timeout=RESTORE_TIMEOUT_S)
        if victim == "restore" and (returncode == 0 or (step_dir / COMMIT_NAME).exists()):
            victim, returncode = "nothing (it was done)", 0  # it wrote its commit record before the kill landed
        fault.found[f"killed {victim}"] += 1
        if victim == "restore":
            fault.found += _check_restored(step_dir, step, complete=False)
            started = time.monotonic()
            returncode = subprocess.run(command, env=daemon_env(), cwd=cluster.work, stdout=log, stderr=log).returncode
    fault.serve_again_s = time.monotonic() - started
    if returncode != 0:
        fault.found["lost"] += 1
        print(f"restore of step {step} failed: {log_path.read_text(errors='replace')[-500:]}", flush=True)
    else:
        fault.found += _check_restored(step_dir, step, complete=True)
    shutil.rmtree(cluster.work / "restored", ignore_errors=True)
    return fault


def _check_restored(step_dir: Path, step: int, complete: bool) -> Counter[str]:
    """Load a restore's output with no daemon: right bytes, or an error when the restore was cut short."""
    found: Counter[str] = Counter()
    try:
        got = ckpt.load_local(step_dir)
    except ckpt.CheckpointError:
        found["lost" if complete else "cut short, refused"] += 1
        return found
    found["checked"] += 1
    if not (step_dir / COMMIT_NAME).exists():
        found["partial visible"] += 1
    if got["step"] != step or not torch.equal(got["w"], state_for(step)["w"]):
        found["wrong bytes"] += 1
    return found


def _damage(kind: str, rng: random.Random, cluster: Cluster) -> Fault | None:
    """Flip a bit in, or cut short, one file of a durable copy; None if no copy is there to damage."""
    if kind == "flip-slot":
        return _flip_slot(rng, cluster)
    if kind == "flip-object":
        steps = sorted(cluster.rank.steps("object"))
        keys = cluster.object_keys(rng.choice(steps)) if steps else []
        if not keys:
            return None
        key = rng.choice(keys)
        step = int(key.split("/")[-2])
        assert cluster.s3 is not None
        body = bytearray(cluster.s3.client.get_object(Bucket=cluster.bucket, Key=key)["Body"].read())
        if body:
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        cluster.s3.client.put_object(Bucket=cluster.bucket, Key=key, Body=bytes(body))
        return Fault(kind, damaged={step: {"object"}})
    tier, where = ("peer", cluster.replica_dir) if kind == "flip-replica" else ("nvme", cluster.nvme_dir)
    steps = sorted(s for s in cluster.rank.steps(tier) if (where(s) / COMMIT_NAME).exists())
    if not steps:
        return None
    step = rng.choice(steps)
    try:
        if kind == "flip-data":
            _flip(rng, where(step) / data_name(0))
        elif kind == "flip-record":
            _flip(rng, where(step) / rng.choice([meta_name(0), COMMIT_NAME]))
        elif kind == "flip-replica":
            _flip(rng, where(step) / rng.choice([data_name(0), meta_name(0), COMMIT_NAME]))
        else:  # truncate
            path = where(step) / data_name(0)
            with open(path, "r+b") as f:
                f.truncate(rng.randrange(0, max(1, path.stat().st_size)))
    except FileNotFoundError:  # retention removed it meanwhile
        return None
    return Fault(kind, damaged={step: {tier}})


def _flip_slot(rng: random.Random, cluster: Cluster) -> Fault | None:
    """Flip a bit in the data of a slot the daemon has checksummed; None if no slot is checksummed yet.

    Only a snapshot already checksummed (its .meta.json marker written) can be caught: a bit flipped
    in RAM before the daemon hashes the slot is in every copy, with checksums that match it, as one
    flipped in the trainer's own tensors would be (docs/DESIGN.md, guarantee 3). The rank is stopped
    meanwhile, so no save reuses the slot (which removes the marker) between the choice and the flip.
    Which step the slot holds is the daemon's to say: the checks load from memory first.
    """
    cluster.rank.pause()
    try:
        hashed = []
        for meta_path in sorted((cluster.a.staging / JOB).glob("rank-*.slot-*.meta.json")):
            slot = meta_path.with_name(meta_path.name.removesuffix(".meta.json"))
            with contextlib.suppress(OSError, ckpt.CheckpointError):  # the daemon may drop the snapshot meanwhile
                hashed.append((slot, ShardMeta.from_bytes(meta_path.read_bytes(), str(meta_path)).data_size_bytes))
        if not hashed:
            return None
        slot, data_size = rng.choice(hashed)
        _flip(rng, slot, data_size)
    finally:
        cluster.rank.resume()
    return Fault(kind="flip-slot")


def _flip(rng: random.Random, path: Path, within: int | None = None) -> None:
    """Flip one bit of the file at random (within: in its first bytes only)."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2) if within is None else within
        if not size:
            return
        at = rng.randrange(size)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
