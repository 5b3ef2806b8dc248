"""Benchmark the training overhead of checkpointing over the whole save window: ckptd against DCP and torch.save.

A real training loop on CPU (benchmarks/training_rank.py: an embedding-heavy transformer
with AdamW, a state of --state-gib) runs --steps steps with a save at the top of steps
1, N+1, 2N+1, ... (N = --every), once per variant, each run a process of its own:

    none         no checkpoints: the baseline
    ckptd        Checkpointer.save_async(state, step)
    ckptd-lazy   save_async(state, step, lazy=True)
    dcp-thread   torch.distributed.checkpoint.async_save, defaults (a thread writes)
    dcp-process  async_save with a DefaultStager (shared memory, background staging), a checkpoint process
    torch-save   torch.save + fsync, synchronous

in two layouts: own-cores (ckptd pinned to the last CPU, the trainer, whatever saves inside
it included, to the others with one torch thread per CPU) and shared (nothing pinned).
Repeats are interleaved: each runs every variant of a layout once, in a rotating order.

The window of a run is from just before its first save until its last checkpoint is
durable, or until its last step ends if that is later; for `none`, the same steps. The
overhead of a variant is (its window - the window of `none` in the same layout and
repeat) / the window of `none`. The target (docs: Performance): ckptd's overhead at most
2 % in own-cores, and below every peer's in both layouts. It prints a table and writes
JSON; it is not a test. See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_training.py --state-gib 1 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from daemon import BenchDaemon
from report import Row, held, table, write_results  # benchmarks/: run as scripts, this directory is on sys.path
from training_rank import VARIANTS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RANK_SCRIPT = Path(__file__).resolve().parent / "training_rank.py"
OURS = ("ckptd", "ckptd-lazy")
PEERS = ("dcp-thread", "dcp-process", "torch-save")
OVERHEAD_TARGET = "<= 1.02"  # window / none's window: at most 2 % more
LAZY_STALL_TARGET = "<= 0.1"  # a lazy save's stall / an eager one's: the lazy save's fixed cost
RUN_TIMEOUT_S = 1800.0
STEP_BASE = 1_000_000  # ckptd's steps of run i start at i * STEP_BASE: every run saves new steps


@dataclass(frozen=True)
class Layout:
    """Where the trainer and the daemon run: their CPUs (empty: any) and the trainer's torch threads."""

    name: str
    trainer_cpus: frozenset[int]
    threads: int
    daemon_cpus: frozenset[int]


def make_layouts(names: list[str]) -> list[Layout]:
    """Return the layouts named: own-cores (ckptd on the last CPU, the trainer on the rest) and shared."""
    cpus = sorted(os.sched_getaffinity(0))
    if "own-cores" in names and len(cpus) < 2:
        raise SystemExit("own-cores needs 2 CPUs or more")
    every = {
        "own-cores": Layout("own-cores", frozenset(cpus[:-1]), len(cpus) - 1, frozenset(cpus[-1:])),
        "shared": Layout("shared", frozenset(), len(cpus), frozenset()),
    }
    return [every[name] for name in names]


def run_trainer(layout: Layout, variant: str, args: argparse.Namespace, daemon: BenchDaemon, run: int) -> dict:
    """Run one trainer process of variant in layout; return its timings (and the daemon's CPU seconds over them).

    The trainer leads a session of its own, so that it is killed with DCP's checkpoint process
    by process group, whatever happens.
    """
    run_dir = daemon.work / f"run-{run}-{variant}"
    run_dir.mkdir()
    out, log_path = run_dir / "result.json", daemon.work / f"run-{run}-{variant}.log"
    command = [sys.executable, str(RANK_SCRIPT), "--variant", variant, "--threads", str(layout.threads)]
    command += ["--steps", str(args.steps), "--every", str(args.every), "--state-gib", str(args.state_gib)]
    command += ["--dir", str(run_dir), "--address", str(daemon.socket_path), "--step-base", str(run * STEP_BASE)]
    assert daemon.proc is not None
    command += ["--daemon-pid", str(daemon.proc.pid)]
    cpus = set(layout.trainer_cpus)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, "--out", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": str(layout.threads)},
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what it left behind (DCP's checkpoint process), or itself
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if code != 0:
        log_text = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{layout.name} {variant} exited with {code}:\n{log_text}")
    result = json.loads(out.read_text())
    shutil.rmtree(run_dir)
    log_path.unlink()
    return {**result, "layout": layout.name}


def run_layout(layout: Layout, args: argparse.Namespace, work: Path, first_run: int) -> tuple[list[dict], list[str]]:
    """Start a daemon pinned as layout says, run every variant --repeats times, interleaved; return runs, warnings."""
    staging = Path(tempfile.mkdtemp(prefix="ckptd-bench-training-", dir="/dev/shm"))
    (work / layout.name).mkdir()
    name, cpus = f"bench-training-{layout.name}", set(layout.daemon_cpus)
    daemon = BenchDaemon(name, work / layout.name, staging, toml="[retention]\nnvme = 2\n", cpus=cpus)
    runs = []
    try:
        daemon.start()
        for repeat in range(args.repeats):
            shift = repeat % len(args.variants)
            for variant in args.variants[shift:] + args.variants[:shift]:
                result = run_trainer(layout, variant, args, daemon, first_run + len(runs))
                runs.append({**result, "repeat": repeat})
                print(
                    f"  {layout.name:<9} repeat {repeat} {variant:<11} window {result['window_s']:7.2f} s, "
                    f"stall median {statistics.median(result['stall_s'] or [0.0]) * 1e3:7.1f} ms",
                    flush=True,
                )
    finally:
        warnings = daemon.stop()
        daemon.kill()
        shutil.rmtree(staging, ignore_errors=True)
    return runs, warnings


def summarize(runs: list[dict]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Return, per (layout, variant), one value per repeat of each figure, the overhead against none included."""
    none = {(r["layout"], r["repeat"]): r["window_s"] for r in runs if r["variant"] == "none"}
    found: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in runs:
        figures = found.setdefault((r["layout"], r["variant"]), {})
        for name, value in (
            ("window_s", r["window_s"]),
            ("ratio", r["window_s"] / none[r["layout"], r["repeat"]]),
            ("steps_per_s", r["steps"] / r["window_s"]),
            ("step_s", r["step_s_median"]),
            ("stall_s", statistics.median(r["stall_s"] or [0.0])),
            ("tail_s", r["tail_s"]),
            ("daemon_cpu_s_per_ckpt", r["daemon_cpu_s"] / max(1, r["saves"])),
        ):
            figures.setdefault(name, []).append(value)
    return found


def build_rows(found: dict, runs: list[dict], layouts: list[Layout], variants: list[str]) -> list[Row]:
    """Turn the figures into rows: each variant's window against none's, ckptd's against the best peer's."""
    rows = []
    saved_bytes = {r["variant"]: r["state_bytes"] * r["saves"] for r in runs}
    state_bytes = runs[0]["state_bytes"]
    for layout in layouts:
        figures = {v: found[layout.name, v] for v in variants}
        median = {v: statistics.median(f["ratio"]) for v, f in figures.items()}
        rows.append(Row(f"{layout.name}: none (limit)", statistics.median(figures["none"]["window_s"]), 0))
        for v in variants[1:]:
            window_s = statistics.median(figures[v]["window_s"])
            what = f"{layout.name}: {v} window"
            if v in OURS and layout.name == "own-cores":
                rows.append(held(what, window_s, saved_bytes[v], "none", median[v], OVERHEAD_TARGET))
            else:
                rows.append(Row(what, window_s, saved_bytes[v], "none", median[v]))
        if "ckptd" in variants and "ckptd-lazy" in variants:  # each repeat's medians, the same repeat's eager one
            lazy, eager = figures["ckptd-lazy"]["stall_s"], figures["ckptd"]["stall_s"]
            ratio = statistics.median(a / b for a, b in zip(lazy, eager, strict=True))
            what = f"{layout.name}: ckptd-lazy stall"
            rows.append(held(what, statistics.median(lazy), state_bytes, "ckptd stall", ratio, LAZY_STALL_TARGET))
        peers = [p for p in PEERS if p in variants]
        if not peers:
            continue
        best = min(peers, key=lambda p: median[p])
        for v in (v for v in OURS if v in variants):
            ratio = statistics.median(a / b for a, b in zip(figures[v]["ratio"], figures[best]["ratio"], strict=True))
            window_s = statistics.median(figures[v]["window_s"])
            what = f"{layout.name}: {v} vs best peer"
            rows.append(Row(what, window_s, saved_bytes[v], best, ratio, "< 1", ratio < 1))
    return rows


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """Format the median and the range of values, times scale: "median [min, max]"."""
    lo, mid, hi = (scale * x for x in (min(values), statistics.median(values), max(values)))
    return f"{mid:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def details(found: dict, layouts: list[Layout], variants: list[str]) -> str:
    """Format each variant's figures per layout: median [min, max] over the repeats."""
    columns = ("steps/s", "overhead %", "stall ms/save", "tail s", "daemon CPU s/ckpt")
    header = f"{'layout':<11}{'variant':<12}" + "".join(f"{c:>24}" for c in columns)
    lines = [header, "-" * len(header)]
    for layout in layouts:
        for v in variants:
            f = found[layout.name, v]
            cells = (
                spread(f["steps_per_s"], digits=2),
                spread([x - 1 for x in f["ratio"]], 100),
                spread(f["stall_s"], 1e3),
                spread(f["tail_s"], digits=2),
                spread(f["daemon_cpu_s_per_ckpt"], digits=2) if v in OURS else "-",
            )
            lines.append(f"{layout.name:<11}{v:<12}" + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-gib", type=float, default=1.0, help="AdamW state (params + 2 moments), GiB (default 1)")
    p.add_argument("--steps", type=int, default=60, help="timed training steps per run (default 60)")
    p.add_argument("--every", type=int, default=10, help="one save per this many steps (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every variant per layout, interleaved (default 3)")
    p.add_argument("--layouts", nargs="+", choices=("own-cores", "shared"), default=["own-cores", "shared"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS[1:], default=list(VARIANTS[1:]), help="besides none")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where to write, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "training.json", help="where to write the results")
    args = p.parse_args()
    args.variants = ["none", *dict.fromkeys(args.variants)]
    return args


def main() -> int:
    """Run every layout, print the tables and write the JSON."""
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that a stopped run still cleans up
    layouts = make_layouts(args.layouts)
    load_before = os.getloadavg()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-training-", dir=args.dir))
    print(f"{args.steps} steps, a save every {args.every}, {args.repeats} repeats; working in {work}", flush=True)
    started = time.monotonic()
    runs, daemon_warnings = [], []
    try:
        for layout in layouts:
            layout_runs, logged = run_layout(layout, args, work, len(runs))
            runs += layout_runs
            daemon_warnings += logged
    finally:
        shutil.rmtree(work, ignore_errors=True)
    found = summarize(runs)
    rows = build_rows(found, runs, layouts, args.variants)
    first = runs[0]
    print(f"\n{' '.join([Path(sys.executable).name, *sys.argv])}  ({time.monotonic() - started:.0f} s)\n")
    print(table(rows))
    print("\nmedian [min, max] over the repeats; overhead against none in the same layout and repeat")
    print(details(found, layouts, args.variants))
    step_s = {layout.name: spread(found[layout.name, "none"]["step_s"], 1e3, 0) for layout in layouts}
    print(
        f"\nstate {first['state_bytes'] / 2**30:.2f} GiB (vocab {first['vocab']}); a training step of none, ms: "
        + ", ".join(f"{name} {s}" for name, s in step_s.items())
    )
    skipped = sum(r["ckptd_skipped"] for r in runs)
    waited_s = sum(r["ckptd_blocked_s"] for r in runs)
    print(f"ckptd saves skipped: {skipped}; save_async waited (blocked_s, warm-up saves included): {waited_s:.2f} s")
    print("ckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(
        args.json,
        load_before,
        rows,
        {"torch": torch.__version__},
        state_bytes=first["state_bytes"],
        steps=args.steps,
        every=args.every,
        repeats=args.repeats,
        layouts={
            layout.name: {
                "trainer_cpus": sorted(layout.trainer_cpus),
                "threads": layout.threads,
                "daemon_cpus": sorted(layout.daemon_cpus),
            }
            for layout in layouts
        },
        dir=str(args.dir.resolve()),
        figures={f"{layout} {variant}": f for (layout, variant), f in found.items()},
        runs=runs,
        daemon_warnings=daemon_warnings,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
