"""A seeded fault campaign against a real daemon and a real training process: kill, flip, truncate, then check.

    .venv/bin/python benchmarks/chaos.py --faults 30 --seed 1

One `ckptd serve` (retention off, so every durable step stays) and one training rank
(benchmarks/chaos_rank.py, saving a known state every step and printing each step once
it is durable on NVMe). Between faults the rank runs a random while; then one fault:

    daemon      kill -9 of the daemon, at a random moment of the rank's saves and flushes
    rank        kill -9 of the training process
    both        both at once
    flip-data   one byte flipped in a durable step's data file on NVMe
    flip-record one byte flipped in a durable step's shard record or commit record
    truncate    a durable step's data file cut short
    flip-slot   one byte flipped in a staging slot (the memory tier)

After each fault, what was killed is started again, and the invariants are checked on
the newest durable steps, the steps the fault touched and a sample of older ones:
every step reported durable and left alone loads bit for bit (else: lost); a step
whose bytes were damaged loads bit for bit or fails with an error, never with other
bytes (else: wrong bytes); every listed step has its commit record (else: partial
visible); the daemon answers again (the time it took). It prints a table per kind of
fault and writes JSON. It is not a test; tests/e2e/test_chaos.py runs a short campaign.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import ckpt
import torch
from chaos_rank import state_for
from ckpt.format import COMMIT_NAME, data_name, meta_name
from ckpt.transport import DaemonClient
from ckpt.wire.v1 import ckptd_pb2 as pb
from daemon import BenchDaemon

KINDS = ("daemon", "rank", "both", "flip-data", "flip-record", "truncate", "flip-slot")
JOB = "chaos"
CHECK_NEWEST = 3
CHECK_SAMPLE = 3
FINAL_NEWEST = 50  # at the end: the newest steps and a sample of every durable step
FINAL_SAMPLE = 450
SERVE_TIMEOUT_S = 60.0


class Rank:
    """The training process, and the steps it reported durable (read from its output on a thread)."""

    def __init__(self, address: str, log_path: Path) -> None:
        self.address = address
        self.log_path = log_path
        self.durable: set[int] = set()
        self.proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        script = Path(__file__).resolve().parent / "chaos_rank.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), self.address, JOB],
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
                word, _, step = line.partition(" ")
                if word == "durable":
                    with self._lock:
                        self.durable.add(int(step))

    def steps(self) -> set[int]:
        with self._lock:
            return set(self.durable)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def restart(daemon: BenchDaemon) -> float:
    """Start the daemon again; return the seconds until it answered."""
    (daemon.work / "notify.sock").unlink(missing_ok=True)
    started = time.monotonic()
    daemon.start()
    return time.monotonic() - started


def damage(rng: random.Random, daemon: BenchDaemon, kind: str, durable: set[int]) -> int | None:
    """Damage one file of a durable step (or a slot); return the step touched, or None if none could be."""
    if kind == "flip-slot":
        slots = [p for p in (daemon.staging / JOB).glob("rank-*.slot-*") if p.suffix.startswith(".slot-")]
        if not slots:
            return None
        path = rng.choice(slots)
        _flip(rng, path)
        return -1  # which step the slot holds is the daemon's to say: every check covers it
    candidates = sorted(s for s in durable if (daemon.root / JOB / str(s) / COMMIT_NAME).exists())
    if not candidates:
        return None
    step = rng.choice(candidates)
    step_dir = daemon.root / JOB / str(step)
    if kind == "flip-data":
        _flip(rng, step_dir / data_name(0))
    elif kind == "flip-record":
        _flip(rng, step_dir / rng.choice([meta_name(0), COMMIT_NAME]))
    else:  # truncate
        path = step_dir / data_name(0)
        with open(path, "r+b") as f:
            f.truncate(rng.randrange(0, max(1, path.stat().st_size)))
    return step


def _flip(rng: random.Random, path: Path) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        if not size:
            return
        at = rng.randrange(size)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))


def check(daemon: BenchDaemon, steps: list[int], damaged: set[int]) -> Counter[str]:
    """Load each step and compare; list the steps and check each has its commit record."""
    found: Counter[str] = Counter()
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(daemon.socket_path)) as c:
        for step in steps:
            expected = state_for(step)
            try:
                got = c.load(step)
            except ckpt.CheckpointError:
                found["unreadable after damage" if step in damaged else "lost"] += 1
                continue
            found["checked"] += 1
            if got["step"] != step or not torch.equal(got["w"], expected["w"]):
                found["wrong bytes"] += 1
    client = DaemonClient(str(daemon.socket_path))
    try:
        listed = client.call("List", pb.ListRequest(job=JOB)).steps
    finally:
        client.close()
    for s in listed:
        if "nvme" in s.tiers and not (daemon.root / JOB / str(s.step) / COMMIT_NAME).exists():
            found["partial visible"] += 1
    return found


def campaign(faults: int, seed: int, work: Path, staging: Path) -> dict[str, dict[str, float]]:
    """Run the campaign; return, per kind of fault, its counts and times."""
    rng = random.Random(seed)
    daemon = BenchDaemon("chaos", work, staging, toml="[retention]\nnvme = 0\n")
    rank = Rank(str(daemon.socket_path), work / "rank.log")
    table: dict[str, Counter[str]] = defaultdict(Counter)
    serve_s: dict[str, list[float]] = defaultdict(list)
    damaged: set[int] = set()
    try:
        daemon.start()
        rank.start()
        injected = attempts = 0
        while injected < faults and attempts < 3 * faults:  # a damage with nothing to damage yet is tried again
            attempts += 1
            time.sleep(rng.uniform(0.05, 0.5))  # a random moment of the rank's saves: the point of a campaign
            kind = KINDS[attempts % len(KINDS)] if attempts <= len(KINDS) else rng.choice(KINDS)
            durable = rank.steps()
            touched = None
            started = time.monotonic()
            if kind in ("daemon", "both"):
                daemon.kill()
            if kind in ("rank", "both"):
                rank.kill()
            if kind in ("daemon", "both"):
                serve_s[kind].append(restart(daemon))
            if kind in ("rank", "both"):
                rank.start()
            if kind.startswith(("flip", "truncate")):
                touched = damage(rng, daemon, kind, durable)
                if touched is None:
                    continue
                damaged.add(touched)
                serve_s[kind].append(time.monotonic() - started)
            table[kind]["injected"] += 1
            injected += 1
            newest = sorted(durable)[-CHECK_NEWEST:]
            older = sorted(durable)[:-CHECK_NEWEST]
            sample = rng.sample(older, min(CHECK_SAMPLE, len(older)))
            steps = sorted(set(newest) | set(sample) | ({touched} if touched and touched >= 0 else set()))
            table[kind] += check(daemon, steps, damaged)
        rank.kill()
        every = sorted(rank.steps())
        final = sorted(set(every[-FINAL_NEWEST:]) | set(rng.sample(every, min(FINAL_SAMPLE, len(every)))))
        table["final"] += check(daemon, final, damaged)
    finally:
        rank.kill()
        daemon.kill()
    return {
        kind: {**counts, "serve_again_s_max": round(max(serve_s.get(kind, [0.0])), 3)} for kind, counts in table.items()
    }


def main() -> int:
    """Run a campaign, print its table, write JSON; exit 1 if anything was lost, wrong or partial."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=30, help="how many faults to inject (default 30)")
    p.add_argument("--seed", type=int, default=1, help="the campaign's seed (default 1)")
    p.add_argument("--json", type=Path, help="where to write the table as JSON")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that a stopped campaign still cleans up
    work = Path(tempfile.mkdtemp(prefix="ckptd-chaos-"))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-chaos-", dir="/dev/shm"))
    started = time.monotonic()
    try:
        table = campaign(args.faults, args.seed, work, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    columns = ("injected", "checked", "lost", "wrong bytes", "partial visible", "unreadable after damage")
    print(f"{'fault':<12}" + "".join(f"{c:>25}" for c in (*columns, "serve_again_s_max")))
    for kind, counts in table.items():
        print(f"{kind:<12}" + "".join(f"{counts.get(c, 0):>25}" for c in (*columns, "serve_again_s_max")))
    print(f"seed {args.seed}, {args.faults} faults, {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "faults": args.faults, "table": table}, indent=1))
    bad = sum(counts.get(c, 0) for counts in table.values() for c in ("lost", "wrong bytes", "partial visible"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
