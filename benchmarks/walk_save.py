"""Walk the calls of one save through the code and say where they go: modules entered, and again, and types met.

    .venv/bin/python benchmarks/walk_save.py [--json FILE]

It starts two real `ckptd serve`, the saving node and its peer, each under a profiler (every
thread; the profile goes to a file when the daemon exits after SIGTERM), with a file:// object
store behind the saving node. A real Checkpointer on this thread saves one small state twice (the
first save makes the slots) and, profiled, waits for the second on NVMe, on the peer and in the
object store. Then, for each leg of the save
(the training thread from save_async to wait; the saving node's Reserve and Commit work, its flush,
its NVMe writes, its replication to the peer and its upload; the peer's receive), it prints the
modules entered in order and how often each was entered: a call from a function of one module into
another's enters the callee's module, so a module entered twice is one a reader following the calls
left and came back to. Last, the types (classes whose methods ran) a reader meets on the way,
counted across the legs. Only the project's own code counts (ckptd/ and client/ckpt/). A daemon's
event loop does other work meanwhile (peering rounds, watches), so its calls are not a leg; the
peer's pools serve peering rounds too, so its receive is the work whose outermost call of ours is
the receiver's (replication/receiving.py, the data channel's listener, the peer servicer) or the
replica store's adoption of the sender's commit record.

A reading aid for docs/INTERNALS.md's walk and issue 35's goals (no module entered twice on the
NVMe write leg; at most 20 types from save_async to the tiers), not a benchmark: it measures no time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import ckpt
import torch
from daemon import BenchDaemon, free_port

REPO = Path(__file__).resolve().parent.parent
OURS = tuple(str(REPO / root) + "/" for root in ("ckptd", "client/ckpt", "client/ckpt_core"))
# The saving node's legs of one save, by the thread names node.Executors gives its pools.
LEGS = {
    "Reserve and Commit (disk work)": ("save",),
    "flush": ("flush",),
    "NVMe writes": ("nvme-io",),
    "replication to the peer": ("replicate", "replicate-stream"),
    "upload": ("upload",),
}
# The peer's receive: what runs on its pools from these roots (module, or module:qualified name).
RECEIVE_THREADS = ("peer", "peer-io", "replica-recv", "data-conn", "records")
RECEIVE_ROOTS = (
    "ckptd.replication.receiving",
    "ckptd.rpc.data_listener",
    "ckptd.rpc.peer_server",
    "ckptd.tiers.nvme:LocalDirTier.adopt_commit",
)
JOB = "walk"

# The profiler, in this process and in each daemon: every thread's calls into our code. A generator or coroutine
# resumed is the same call going on, not an entry: RESUME's argument says where (its low bits are 0 only at a
# function's start).
PROFILER = """
import inspect, sys, threading, time
RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
def start_profiling(ours, calls):
    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(ours):
            return
        if code.co_flags & RESUMABLE and code.co_code[frame.f_lasti + 1] & 3:
            return
        back, outer, root = frame.f_back, frame.f_back, frame
        while outer is not None:
            if outer.f_code.co_filename.startswith(ours):
                root = outer
            outer = outer.f_back
        calls.append((time.monotonic(), threading.current_thread().name, back.f_code.co_filename if back else "",
                      code.co_filename, code.co_qualname, root.f_code.co_filename + ":" + root.f_code.co_qualname))
    sys.setprofile(profile)
    threading.setprofile(profile)
"""
# Run in each daemon: profile it from the start, write the calls out at exit.
PROFILED_DAEMON = (
    PROFILER
    + """
import atexit, json, os
calls = []
start_profiling(tuple(json.loads(os.environ["WALK_OURS"])), calls)
atexit.register(lambda: json.dump(calls, open(os.environ["WALK_TRACE"], "w")))
from ckptd.cli import main
sys.exit(main(sys.argv[1:]))
"""
)

# when, thread, caller's file, callee's file, callee's qualified name, and the outermost call of ours on that
# thread's stack as "file:qualified name" (in a daemon's pool, the work item it runs)
Call = tuple[str | float, ...]


def module(path: str) -> str:
    """Name a file of ours as its module (ckptd.save.flush, ckpt.checkpointer); "" for anything else."""
    for root in OURS:
        if path.startswith(root):
            return ".".join([Path(root).name, *Path(path[len(root) :]).with_suffix("").parts])
    return ""


def pool_of(thread: str) -> str:
    """Return the pool a daemon thread belongs to ("flush_0" -> "flush")."""
    return thread.rsplit("_", 1)[0]


def received(call: Call) -> bool:
    """Say whether a call on the peer is part of its receive (its root is one of RECEIVE_ROOTS)."""
    path, _, qualname = str(call[5]).partition(":")
    return pool_of(str(call[1])) in RECEIVE_THREADS and (
        module(path) in RECEIVE_ROOTS or f"{module(path)}:{qualname}" in RECEIVE_ROOTS
    )


def entries(calls: list[Call]) -> list[str]:
    """Return the modules entered, in order: calls whose caller is in another module (or outside our code)."""
    return [module(str(c[3])) for c in calls if module(str(c[2])) != module(str(c[3]))]


def types_met(calls: list[Call]) -> set[str]:
    """Return the classes whose methods ran ("ckptd.save.flush.Flusher"), private ones ("_FileParts") too."""
    found = set()
    for call in calls:
        callee, parts = str(call[3]), str(call[4]).split(".")
        if len(parts) >= 2 and parts[-2] != "<locals>" and parts[-2].lstrip("_")[:1].isupper():
            found.add(f"{module(callee)}.{parts[-2]}")
    return found


def profile_this_process(calls: list[Call]) -> None:
    """Append every call of this process's threads into our code to calls, from now until sys.setprofile(None)."""
    namespace: dict[str, Any] = {}
    exec(PROFILER, namespace)
    namespace["start_profiling"](OURS, calls)


def profiled(name: str, work: Path, staging: Path, listen: str, peer: str, toml: str = "") -> BenchDaemon:
    """Return a daemon (not yet started) that runs under PROFILED_DAEMON, with peer as its one peer."""
    (work / name).mkdir()
    return BenchDaemon(
        name, work / name, staging / name, listen=listen,
        toml=f"[peer]\naddresses = [{json.dumps(peer)}]\nreplicas = 1\ninsecure = true\n\n{toml}",
        program=("-c", PROFILED_DAEMON),
        env={"WALK_TRACE": str(work / name / "calls.json"), "WALK_OURS": json.dumps(OURS)},
    )  # fmt: skip


def calls_of(daemon: BenchDaemon) -> list[Call]:
    """Return the calls a profiled daemon wrote out when it exited."""
    return [tuple(call) for call in json.loads((daemon.work / "calls.json").read_text())]


def walk() -> dict[str, Any]:
    """Save one state through two profiled daemons; return each leg's entries and the types met."""
    work = Path(tempfile.mkdtemp(prefix="ckpt-walk-"))
    staging = Path("/dev/shm") / f"ckpt-walk-{uuid.uuid4().hex[:12]}"
    a_listen, b_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    saver = profiled("saver", work, staging, a_listen, b_listen, f'[object]\nurl = "file://{work / "store"}"\n')
    peer = profiled("peer", work, staging, b_listen, a_listen)
    client_calls: list[Call] = []
    try:
        staging.mkdir()
        # Both start before either is waited for, so neither asks a peer that is not there yet.
        notify_saver, notify_peer = saver.launch(), peer.launch()
        saver.wait_ready(notify_saver)
        peer.wait_ready(notify_peer)
        state = {"model": {"w": torch.randn(256, 1024), "b": torch.zeros(1024)}, "step": 1}
        with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(saver.socket_path)) as c:
            first = c.save_async(state, step=1)  # a first save: the slots are made; the walk is the second
            for tier in ("nvme", "peer", "object"):
                first.wait(tier)
            started = time.monotonic()
            profile_this_process(client_calls)
            try:
                handle = c.save_async(state, step=2)
                for tier in ("nvme", "peer", "object"):
                    handle.wait(tier)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            ended = time.monotonic()
        saver.stop()
        peer.stop()
        on_saver = [c for c in calls_of(saver) if started <= float(c[0]) <= ended]
        on_peer = [c for c in calls_of(peer) if started <= float(c[0]) <= ended]
    finally:
        saver.kill()
        peer.kill()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    legs = {"training thread (save_async .. wait)": [c for c in client_calls if c[1] == "MainThread"]}
    for name, pools in LEGS.items():
        legs[f"saving node: {name}"] = [c for c in on_saver if pool_of(str(c[1])) in pools]
    legs["peer: receive"] = [c for c in on_peer if received(c)]
    return {
        name: {"entries": entries(calls), "types": sorted(types_met(calls))} for name, calls in legs.items() if calls
    }


def report(found: dict[str, Any]) -> None:
    everything: set[str] = set()
    for name, leg in found.items():
        counts = Counter(leg["entries"])
        again = {m: n for m, n in counts.items() if n > 1}
        entered = len(leg["entries"])
        print(f"\n{name}: {len(counts)} modules, entered {entered} times ({entered - len(counts)} again), "
              f"{len(leg['types'])} types")  # fmt: skip
        print("  entered in order: " + " > ".join(dict.fromkeys(leg["entries"])))
        print("  entered more than once: " + (", ".join(f"{m} {n}x" for m, n in sorted(again.items())) or "none"))
        everything |= set(leg["types"])
    print(f"\ntypes met across the legs: {len(everything)}")
    for name in sorted(everything):
        print(f"  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write what was found here too")
    args = parser.parse_args()
    found = walk()
    report(found)
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
