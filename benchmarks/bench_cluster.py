"""The cluster view at 10, 100 and 1,000 simulated nodes of 8 ranks, on both backends: messages, bytes, CPU, latency.

Usage: .venv/bin/python benchmarks/bench_cluster.py [--nodes 10,100,1000] [--backend peers,etcd]

Nodes are the real views (ckptd.cluster) over their real transport on loopback, many per
process (cluster_node.py, --procs processes); a node reports its 8 ranks durable the way
Peering does after a flush. Per step and node it counts the messages and bytes the view
sent and received (heartbeats, membership and anti-entropy apart, per second), the CPU
seconds, and the time from the last report to the commit known on every node. Process 0
hosts the job's coordinator alone, so its CPU per step is the coordinator's own.

On 2 cores, 1,000 nodes share the CPU the real nodes would each have, so the measured
latency there is mostly queueing. Alongside it the benchmark prints a modelled latency:
the coordinator's CPU per step plus the hops on the critical path times the per-hop
round trip measured on the idle system (docs/INTERNALS.md, "The cluster view").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster_node import run_worker

from ckptd.cluster.peers_view import FANOUT
from ckptd.cluster.view import coordinator_of


def _etcd_server_class() -> Any:
    """Load the tests' real etcd launcher (tests/etcd_server.py: one of them) without putting tests/ on the path."""
    path = Path(__file__).resolve().parent.parent / "tests" / "etcd_server.py"
    spec = importlib.util.spec_from_file_location("etcd_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EtcdServer


RESULTS_DIR = Path(__file__).resolve().parent / "results"
STEP_KINDS = ("report", "announce", "Put", "Txn", "watch_event")  # the messages of a step (peers, etcd)
PERIODIC_WINDOW_S = 20.0  # twice the default anti-entropy period: heartbeats and digests per second


class Workers:
    """The worker processes, each answering one command at a time."""

    def __init__(self, procs: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns = []
        self.procs = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=run_worker, args=(child,), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def all(self, *command: Any) -> list[Any]:
        for conn in self.conns:
            conn.send(command)
        return [conn.recv() for conn in self.conns]

    def each(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        for conn, command in zip(self.conns, commands, strict=True):
            conn.send(command)
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
                conn.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _split(n: int, procs: int) -> list[int]:
    """Process 0 hosts one node (the coordinator); the others share the rest."""
    rest = procs - 1
    return [1] + [(n - 1) // rest + (1 if i < (n - 1) % rest else 0) for i in range(rest)]


def _messages(counters: dict[str, int], kinds: tuple[str, ...]) -> tuple[int, int]:
    """Return (messages, bytes) sent and received of the given kinds."""
    count = sum(v for k, v in counters.items() if k.split(".", 1)[0] in ("sent", "received") and _kind(k) in kinds)
    size = sum(v for k, v in counters.items() if k.split(".", 1)[0].endswith("_bytes") and _kind(k) in kinds)
    return count, size


def _kind(key: str) -> str:
    return key.split(".", 1)[1] if "." in key else key


def _cpu_s_of(pid: int) -> float:
    """Return a process's CPU seconds so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_size(backend: str, n: int, args: argparse.Namespace, etcd: str, etcd_pid: int = 0) -> dict[str, Any]:
    procs = max(2, min(args.procs, n))
    counts = _split(n, procs)
    workers = Workers(procs)
    try:
        addresses_by_proc = workers.each([("bind", c, backend) for c in counts])
        addresses = [a for group in addresses_by_proc for a in group]
        coordinator = addresses_by_proc[0][0]
        job = next(f"bench-{i}" for i in range(100 * n) if coordinator_of(f"bench-{i}", addresses) == coordinator)
        settings = {"addresses": addresses, "ranks": args.ranks, "backend": backend, "etcd": etcd,
                    "anti_entropy_s": args.anti_entropy_s}  # fmt: skip
        started = time.monotonic()
        progress(f"{backend} N={n}: {procs} processes bound their nodes; starting the views")
        workers.all("start", settings)
        while min(workers.all("members")) < n - 1:
            assert time.monotonic() - started < args.timeout_s, "the nodes did not all see each other"
            time.sleep(0.2)  # polls the workers' membership while it settles
        progress(f"{backend} N={n}: every node sees the others after {time.monotonic() - started:.1f} s")
        hop = statistics.median(
            workers.each([("hop", addresses_by_proc[1][0], 20, n * args.ranks)] + [("hop", "", 0, 0)] * (procs - 1))[0]
        )
        steps = []
        for step in range(1, args.steps + 1):
            etcd_cpu = _cpu_s_of(etcd_pid) if etcd_pid else 0.0
            answers = workers.all("step", job, step, args.timeout_s)
            etcd_cpu = _cpu_s_of(etcd_pid) - etcd_cpu if etcd_pid else 0.0
            progress(f"{backend} N={n}: step {step} known committed on {sum(a['learned'] for a in answers)} nodes")
            learned = sum(a["learned"] for a in answers)
            last_report = max(a["reported_at"] for a in answers)
            per_node = [c for a in answers for c in a["per_node"]]
            msgs = [_messages(c, STEP_KINDS) for c in per_node]
            steps.append({
                "learned_by": learned,
                "commit_known_everywhere_s": max(a["last_learned"] for a in answers) - last_report,
                "messages_per_node_mean": statistics.mean(m for m, _ in msgs),
                "messages_per_node_max": max(m for m, _ in msgs),
                "messages_coordinator": msgs[0][0],
                "bytes_per_node_mean": statistics.mean(b for _, b in msgs),
                "cpu_s_per_node": sum(a["cpu_s"] for a in answers) / n,
                "coordinator_cpu_s": answers[0]["cpu_s"],
                "etcd_server_cpu_s": etcd_cpu,
                "calls_by_kind": _calls_by_kind(per_node),  # summed over the nodes: sent, received, failed
            })  # fmt: skip
        periodic = [c for group in workers.all("periodic", PERIODIC_WINDOW_S) for c in group]
        per_s = statistics.mean(
            sum(v for k, v in c.items() if k.split(".", 1)[0] in ("sent", "received")) for c in periodic
        )
    finally:
        workers.close()
    measured = steps[1:] or steps  # the first step opens channels and watches
    coordinator_cpu = statistics.median(s["coordinator_cpu_s"] for s in measured)
    etcd_cpu = statistics.median(s["etcd_server_cpu_s"] for s in measured)
    hops = 2 if backend == "etcd" else 1 + math.ceil(math.log(max(n - 1, 2), FANOUT))
    return {
        "backend": backend,
        "nodes": n,
        "ranks": n * args.ranks,
        "procs": procs,
        "steps": steps,
        "messages_per_node_per_step": statistics.median(s["messages_per_node_mean"] for s in measured),
        "messages_max_node_per_step": statistics.median(s["messages_per_node_max"] for s in measured),
        "bytes_per_node_per_step": statistics.median(s["bytes_per_node_mean"] for s in measured),
        "cpu_s_per_node_per_step": statistics.median(s["cpu_s_per_node"] for s in measured),
        "coordinator_cpu_s_per_step": coordinator_cpu,
        "commit_known_everywhere_s": statistics.median(s["commit_known_everywhere_s"] for s in measured),
        "hop_rtt_s": hop,
        "hops": hops,
        "etcd_server_cpu_s_per_step": etcd_cpu,
        # The critical path on machines of their own: the coordinator's work for the step, etcd's
        # (its watch events to every node), and the hops, each timed with a record of the step's size.
        "modelled_commit_s": coordinator_cpu + etcd_cpu + hops * hop,
        "periodic_messages_per_node_per_s": per_s / PERIODIC_WINDOW_S,
    }


def _calls_by_kind(per_node: list[dict[str, int]]) -> dict[str, int]:
    """Sum the nodes' call counters, bytes left out: how many reports, announcements, digests, failures."""
    total: dict[str, int] = {}
    for c in per_node:
        for k, v in c.items():
            if not k.split(".", 1)[0].endswith("_bytes"):
                total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['backend']:5} N={row['nodes']:5}  msgs/node/step {row['messages_per_node_per_step']:6.2f} "
        f"(max node {row['messages_max_node_per_step']:5.0f})  bytes/node/step {row['bytes_per_node_per_step']:9.0f}  "
        f"cpu/node/step {row['cpu_s_per_node_per_step'] * 1e3:7.2f} ms  commit everywhere "
        f"{row['commit_known_everywhere_s']:6.3f} s measured, {row['modelled_commit_s']:6.3f} s modelled  "
        f"periodic {row['periodic_messages_per_node_per_s']:.2f} msgs/node/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="10,100,1000", help="cluster sizes, comma-separated")
    p.add_argument("--backend", default="peers,etcd", help="peers, etcd, or both")
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--steps", type=int, default=3, help="steps saved per size (the first is not counted)")
    p.add_argument("--procs", type=int, default=12, help="worker processes hosting the nodes")
    p.add_argument("--anti-entropy-s", type=int, default=10, help="[cluster] anti_entropy_s of the nodes")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up on a step or start-up after this long")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "cluster.json", help="where to write the results")
    args = p.parse_args()
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # the workers inherit it: no line per closed connection
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for backend in args.backend.split(","):
            etcd = _etcd_server_class()(Path(tmp) / "etcd") if backend == "etcd" else None
            try:
                if etcd is not None:
                    etcd.start()
                for n in (int(x) for x in args.nodes.split(",")):
                    row = run_size(backend, n, args, etcd.endpoint if etcd else "", etcd.proc.pid if etcd else 0)
                    rows.append(row)
                    print(_line(row), flush=True)
            finally:
                if etcd is not None:
                    etcd.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
