"""Walk the calls of one save through the code and say where they go: modules entered, and again, and types met.

    .venv/bin/python benchmarks/walk_save.py [--object] [--json FILE]

It starts a real `ckptd serve` under a profiler (every thread; the profile goes to a file when
the daemon exits after SIGTERM), saves one small state with a real Checkpointer on this thread
(profiled too) and waits for it on NVMe (with --object, in a file:// object store as well). Then,
for each leg of the save (the training thread from save_async to wait; the daemon's Reserve and
Commit work, its flush, its NVMe writes, its upload), it prints the modules entered in order and
how often each was entered: a call from a function of one module into a function of another
enters the callee's module, so a module entered twice is one a reader following the calls left
and came back to. Last, the types (classes whose methods ran) a reader meets on the way, counted
across the legs. Only the project's own code counts (ckptd/ and client/ckpt/); the daemon's event
loop does other work meanwhile (peering rounds, watches), so its calls are not a leg.

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
from daemon import BenchDaemon

REPO = Path(__file__).resolve().parent.parent
OURS = (str(REPO / "ckptd") + "/", str(REPO / "client" / "ckpt") + "/")
# The daemon's legs of one save, by the thread names node.Executors gives its pools.
LEGS = {"save": "Reserve and Commit (disk work)", "flush": "flush", "nvme-io": "NVMe writes", "upload": "upload"}

# Run in the daemon: profile every thread's calls into our code, write them out at exit.
PROFILED_DAEMON = """
import atexit, json, os, sys, threading, time
ours, calls = tuple(json.loads(os.environ["WALK_OURS"])), []
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(ours):
        back = frame.f_back
        calls.append((time.monotonic(), threading.current_thread().name, back.f_code.co_filename if back else "",
                      frame.f_code.co_filename, frame.f_code.co_qualname))
sys.setprofile(profile)
threading.setprofile(profile)
atexit.register(lambda: json.dump(calls, open(os.environ["WALK_TRACE"], "w")))
from ckptd.cli import main
sys.exit(main(sys.argv[1:]))
"""

Call = tuple[float, str, str, str, str]  # when, thread, caller's file, callee's file, callee's qualified name


def module(path: str) -> str:
    """Name a file of ours as its module (ckptd.save.flush, ckpt.checkpointer); "" for anything else."""
    for root in OURS:
        if path.startswith(root):
            package = "ckptd" if root.endswith("ckptd/") else "ckpt"
            return ".".join([package, *Path(path[len(root) :]).with_suffix("").parts])
    return ""


def leg_of(thread: str) -> str | None:
    """Return the leg a daemon thread works for ("flush_0" -> "flush"), None for the others."""
    prefix = thread.rsplit("_", 1)[0]
    return prefix if prefix in LEGS else None


def entries(calls: list[Call]) -> list[str]:
    """Return the modules entered, in order: calls whose caller is in another module (or outside our code)."""
    return [module(callee) for _, _, caller, callee, _ in calls if module(caller) != module(callee)]


def types_met(calls: list[Call]) -> set[str]:
    """Return the classes whose methods ran ("ckptd.save.flush.Flusher")."""
    found = set()
    for _, _, _, callee, qualname in calls:
        parts = qualname.split(".")
        if len(parts) >= 2 and parts[-2] != "<locals>" and parts[-2][:1].isupper():
            found.add(f"{module(callee)}.{parts[-2]}")
    return found


def profile_this_process(calls: list[Call]) -> None:
    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(OURS):
            back = frame.f_back
            code = frame.f_code
            caller = back.f_code.co_filename if back else ""
            calls.append(
                (time.monotonic(), threading.current_thread().name, caller, code.co_filename, code.co_qualname)
            )

    sys.setprofile(profile)
    threading.setprofile(profile)


def walk(use_object: bool) -> dict[str, Any]:
    """Save one state through a profiled daemon; return each leg's entries and the types met."""
    work = Path(tempfile.mkdtemp(prefix="ckpt-walk-"))
    staging = Path("/dev/shm") / f"ckpt-walk-{uuid.uuid4().hex[:12]}"
    trace = work / "daemon-calls.json"
    toml = f'[object]\nurl = "file://{work / "store"}"\n' if use_object else ""
    daemon = BenchDaemon(
        "walk", work, staging, toml=toml, program=("-c", PROFILED_DAEMON),
        env={"WALK_TRACE": str(trace), "WALK_OURS": json.dumps(OURS)},
    )  # fmt: skip
    client_calls: list[Call] = []
    try:
        daemon.start()
        state = {"model": {"w": torch.randn(256, 1024), "b": torch.zeros(1024)}, "step": 1}
        with ckpt.Checkpointer(job="walk", rank=0, world_size=1, address=str(daemon.socket_path)) as c:
            c.save_async(state, step=1).wait("nvme")  # a first save: the slots are made; the walk is the second
            started = time.monotonic()
            profile_this_process(client_calls)
            try:
                handle = c.save_async(state, step=2)
                handle.wait("object" if use_object else "nvme")
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            ended = time.monotonic()
        daemon.stop()
        daemon_calls: list[Call] = [tuple(c) for c in json.loads(trace.read_text())]  # type: ignore[misc]
    finally:
        daemon.kill()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    during = [c for c in daemon_calls if started <= c[0] <= ended]
    training = [c for c in client_calls if c[1] == "MainThread"]
    legs = {"training thread (save_async .. wait)": training}
    for prefix, name in LEGS.items():
        legs[f"daemon: {name}"] = [c for c in during if leg_of(c[1]) == prefix]
    return {
        name: {"entries": entries(calls), "types": sorted(types_met(calls))} for name, calls in legs.items() if calls
    }


def report(found: dict[str, Any]) -> None:
    everything: set[str] = set()
    for name, leg in found.items():
        counts = Counter(leg["entries"])
        again = {m: n for m, n in counts.items() if n > 1}
        print(f"\n{name}: {len(counts)} modules, {len(leg['types'])} types")
        print("  entered in order: " + " > ".join(dict.fromkeys(leg["entries"])))
        print("  entered more than once: " + (", ".join(f"{m} {n}x" for m, n in sorted(again.items())) or "none"))
        everything |= set(leg["types"])
    print(f"\ntypes met across the legs: {len(everything)}")
    for name in sorted(everything):
        print(f"  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--object", action="store_true", help="also upload to a file:// object store, and walk that")
    parser.add_argument("--json", type=Path, help="write what was found here too")
    args = parser.parse_args()
    found = walk(args.object)
    report(found)
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
