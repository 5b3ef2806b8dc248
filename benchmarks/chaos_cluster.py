"""The system a fault campaign runs against: three nodes, an object store behind a fault proxy, one training rank.

chaos.py builds a Cluster in its work directory, start()s it, injects faults through
its parts (chaos_faults.py) and stop()s it on the way out, also when it fails:

    a       `ckptd serve` the rank saves to; its NVMe root on a small tmpfs (SmallDisk)
            so that the disk can be filled; replicas to b or c; every EVERY-th step to the store
    b, c    `ckptd serve`, a's peers: `[peer] replicas = 1` places a's replica of each step on one
            of them (rendezvous hashing: placed_peer()); the other stands in for it once it has
            failed for FAILOVER_S ([peer] failover_s). Each keeps its replicas under its root's .peer
    store   moto's S3 server, reached by a through a FaultProxy only
    rank    chaos_rank.py: saves a state known from its step, prints the tiers each step reached

Given a Network (tests/netns.py), a, b and c run as hosts, each in a network namespace of its
own, and the FaultProxy listens on a fourth host, "store": the network faults (chaos_network.py)
cut the links between them. Without one, everything shares loopback. The rank, the checks and
the CLI reach a node by its unix socket, which no cut touches.

Rank reads those lines on a thread and keeps, per tier, the steps reported durable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from daemon import BenchDaemon, free_port
from fault_proxy import FaultProxy
from s3_server import S3_KEY, S3Server

from ckptd.cluster.placement import reseat, seated_placement

# netns: the tests' harness, one copy. Appended only after ckptd is imported: tests/ holds a ckptd folder of
# unit tests, which an editable install's finder (after the path's) would otherwise lose to as a namespace package.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
from netns import Host, Network, run_in

JOB = "chaos"
EVERY = 4  # [object] every: a step in four goes to the store
RETENTION = {"nvme": 4, "peer": 6, "object": 0}
DISK_BYTES = 512 << 20
BALLAST_BLOCK = 1 << 20
TIERS = ("nvme", "peer", "object")
FAILOVER_S = 2.0  # [peer] failover_s of every node: short, so that a campaign sees stand-ins come and go
T = TypeVar("T")
HOST_PEER_PORT = 7070  # a node's peer port on a host of its own, where nothing else can hold it


class SmallDisk:
    """A directory on a tmpfs of its own, so that a campaign can fill it; a plain directory where mounting fails."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        path.mkdir(parents=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "ckptd-chaos", str(path)]
        self.mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
        self.ballast = path / "ballast"

    def fill(self) -> int:
        """Write a ballast file until the disk is full; return its size."""
        block = b"\0" * BALLAST_BLOCK
        written = 0
        with open(self.ballast, "ab") as f:
            while True:
                try:
                    written += f.write(block)
                    f.flush()
                except OSError:  # ENOSPC: full, the point
                    return written

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def close(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "--lazy", str(self.path)], check=False)


class Rank:
    """The training process, and the steps it reported durable on each tier (read from its output on a thread)."""

    def __init__(self, address: str, log_path: Path) -> None:
        self.address = address
        self.log_path = log_path
        self.reported: dict[str, dict[int, float]] = {tier: {} for tier in TIERS}  # tier -> step -> when
        self.newest_attempted = -1  # the newest step it printed anything about (durable or failed)
        self.failed_saves = 0
        self.proc: subprocess.Popen[str] | None = None
        self._changed = threading.Condition()

    def start(self) -> None:
        script = Path(__file__).resolve().parent / "chaos_rank.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), self.address, JOB, str(EVERY)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with open(self.log_path, "a") as log:
            for line in proc.stdout:
                log.write(line)
                words = line.split()
                if len(words) < 2 or not words[1].isdigit():
                    continue
                with self._changed:
                    self.newest_attempted = max(self.newest_attempted, int(words[1]))
                    if words[0] == "durable" and len(words) == 3:
                        self.reported[words[2]][int(words[1])] = time.monotonic()
                    elif words[0] == "failed":
                        self.failed_saves += 1
                    self._changed.notify_all()

    def steps(self, tier: str) -> dict[int, float]:
        """Return {step: when it was reported} for the steps reported durable on tier."""
        with self._changed:
            return dict(self.reported[tier])

    def wait_report(self, tier: str, after: float, timeout_s: float) -> float | None:
        """Wait for a step reported durable on tier later than after (monotonic); return when, or None."""
        with self._changed:
            reported = self._changed.wait_for(
                lambda: max(self.reported[tier].values(), default=0.0) > after, timeout=timeout_s
            )
            return max(self.reported[tier].values()) if reported else None

    def pause(self) -> None:
        """Stop the rank (SIGSTOP) so that no newer step pushes the checked ones out of retention."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Cluster:
    """Start, restart and stop the campaign's processes; say where each tier keeps a step."""

    def __init__(self, work: Path, staging: Path, network: Network | None = None) -> None:
        """Lay the cluster out (on network's hosts, if given: see the module docstring); start() starts it."""
        self.work = work
        self.network = network
        self.disk = SmallDisk(work / "disk-a", DISK_BYTES)
        self.s3: S3Server | None = None
        self.proxy: FaultProxy | None = None
        self.bucket = ""
        self.hosts: dict[str, Host] = {}  # "a", "b", "c", "store" -> its host, on a network
        if network is not None:
            self.hosts = {name: network.host(name) for name in ("a", "b", "c", "store")}
            a_listen, b_listen, c_listen = (f"{self.hosts[n].address}:{HOST_PEER_PORT}" for n in "abc")
        else:
            a_listen, b_listen, c_listen = (f"127.0.0.1:{free_port()}" for _ in range(3))
        retention = "[retention]\n" + "".join(f"{tier} = {keep}\n" for tier, keep in RETENTION.items())
        wrappers = {name: tuple(host.command()) for name, host in self.hosts.items()}
        self.a = BenchDaemon("a", work / "a", staging / "a", a_listen, root_parent=self.disk.path)
        self.b = BenchDaemon("b", work / "b", staging / "b", b_listen, toml=_peer_toml(a_listen, c_listen) + retention)
        self.c = BenchDaemon("c", work / "c", staging / "c", c_listen, toml=_peer_toml(a_listen, b_listen) + retention)
        self.peers = (self.b, self.c)
        for node in (self.a, *self.peers):
            node.wrapper = wrappers.get(node.name, ())
        self._a_toml = _peer_toml(b_listen, c_listen) + retention
        self.rank = Rank(str(self.a.socket_path), work / "rank.log")
        self.peer_downs = 0  # peer-down faults so far (chaos_faults: the first takes the placed peer down)

    def start(self) -> None:
        """Start the store, the proxy, the three nodes and the rank."""
        self.s3 = S3Server(self.work / "moto.log")
        self.bucket = self.s3.new_bucket("chaos")
        store = self.hosts.get("store")
        listener = run_in(store, lambda: socket.create_server((store.address, 0))) if store else None
        self.proxy = FaultProxy(int(self.s3.endpoint.rsplit(":", 1)[1]), listener)
        options = {"key": S3_KEY, "secret": S3_KEY, "client_kwargs": {"endpoint_url": self.proxy.endpoint}}
        self.a.toml = (
            self._a_toml
            + f"[object]\nurl = {json.dumps(f's3://{self.bucket}/ckpt')}\nevery = {EVERY}\n"
            + f"storage_options = {_inline_table(options)}\n"
        )
        for node in (self.a, *self.peers):
            node.work.mkdir(parents=True, exist_ok=True)
            node.staging.mkdir(parents=True, exist_ok=True)
        for node in (*self.peers, self.a):
            node.start()
        self.rank.start()

    def restart(self, node: BenchDaemon) -> float:
        """Start a killed node again; return the seconds until it said it is ready."""
        (node.work / "notify.sock").unlink(missing_ok=True)
        started = time.monotonic()
        node.start()
        return time.monotonic() - started

    def stop(self) -> None:
        """Kill everything this cluster started and unmount its disk; safe to call on a half-started one."""
        self.rank.kill()
        for node in (self.a, *self.peers):
            if node.proc is not None and node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGCONT)  # a stalled node must die too
            node.kill()
        if self.proxy is not None:
            self.proxy.close()
        if self.s3 is not None:
            self.s3.stop()
        self.disk.close()

    def host(self, node: BenchDaemon) -> Host:
        """Return the host a node runs on (a network's only)."""
        return self.hosts[node.name]

    def from_a(self, work: Callable[[], T]) -> T:
        """Run work where node a is on the network (its host's namespace, or here on loopback)."""
        return run_in(self.hosts["a"], work) if self.hosts else work()

    # -- where each tier keeps a step ------------------------------------------------------

    def nvme_dir(self, step: int) -> Path:
        return self.a.root / JOB / str(step)

    def replica_dirs(self, step: int) -> list[Path]:
        """Return where b and c would keep a step's replica (one of them does; both may, for a while)."""
        return [node.root / ".peer" / JOB / str(step) for node in self.peers]

    def replica_dir(self, step: int) -> Path:
        """Return the replica of a step that is there, on b or c (b's place if neither holds it)."""
        there = [d for d in self.replica_dirs(step) if d.is_dir()]
        return (there or self.replica_dirs(step))[0]

    def placed_peer(self) -> BenchDaemon:
        """Return the peer a places the rank's replicas on (what its Replication computes from the addresses)."""
        placed = seated_placement(JOB, 0, reseat({}, [p.listen for p in self.peers]), 1)
        return next(p for p in self.peers if p.listen in placed)

    def object_keys(self, step: int) -> list[str]:
        """Return the keys of the objects the store holds for a step."""
        assert self.s3 is not None
        listed = self.s3.client.list_objects_v2(Bucket=self.bucket, Prefix=f"ckpt/{JOB}/{step}/")
        return [o["Key"] for o in listed.get("Contents", [])]


def _peer_toml(*peers: str) -> str:
    # Plaintext on loopback, said explicitly: the campaign is about faults, not about who may connect.
    addresses = ", ".join(json.dumps(p) for p in peers)
    return f"[peer]\naddresses = [{addresses}]\nreplicas = 1\ninsecure = true\nfailover_s = {FAILOVER_S}\n"


def _inline_table(value: dict[str, object]) -> str:
    """Return a TOML inline table of strings and nested tables."""
    items = (f"{k} = {_inline_table(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in value.items())
    return "{" + ", ".join(items) + "}"
