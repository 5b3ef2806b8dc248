"""Kill a training run with SIGKILL, resume it from ckptd, and check it continues bit for bit.

    python examples/demo.py

The demo starts a real `ckptd serve` in a temporary directory and trains a tiny
transformer language model (examples/tiny_transformer.py) three times:
  1. a reference run, uninterrupted and without checkpoints;
  2. a run that saves asynchronously every few steps and is killed with SIGKILL mid-run;
  3. the same command again, which resumes from the latest checkpoint.
It then compares, step by step, the losses of the resumed run with the reference as
floats, prints IDENTICAL or DIFFERENT, and exits 0 only if every loss is identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ckpt

TRAIN_SCRIPT = Path(__file__).with_name("tiny_transformer.py")
JOB = "tiny-transformer"
STEPS = 60
CKPT_EVERY = 10
KILL_AFTER_STEP = 35
DAEMON_START_TIMEOUT_S = 30.0
DAEMON_STOP_TIMEOUT_S = 30.0
TRAIN_TIMEOUT_S = 120.0


class DemoFailed(Exception):
    """A step of the demo did not go as it must."""


def heading(text: str) -> None:
    """Print a phase heading."""
    print(f"\n== {text} ==", flush=True)


def ckptd_command() -> list[str]:
    """Return the command that runs ckptd from this interpreter's environment."""
    script = Path(sys.executable).with_name("ckptd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptd"]


def write_config(work_dir: Path, staging_dir: Path) -> Path:
    """Write a ckptd config that keeps every file of the demo in work_dir and staging_dir."""
    config = work_dir / "ckptd.toml"
    config.write_text(
        f'[node]\nroot = "{work_dir / "nvme"}"\nsocket = "{work_dir / "ckptd.sock"}"\n\n'
        f'[staging]\ndir = "{staging_dir}"\n'
    )
    return config


@contextmanager
def running_daemon(config: Path, socket_path: Path, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run `ckptd serve` until the block ends, then stop it with SIGTERM and insist on exit status 0."""
    command = [*ckptd_command(), "serve", "--config", str(config)]
    with log_path.open("wb") as log:
        daemon = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        print(f"$ ckptd serve --config {config}")
        waited_s = wait_until_answering(daemon, socket_path)
        print(f"daemon pid {daemon.pid} answering on {socket_path} after {waited_s:.1f} s")
        yield daemon
    except BaseException:
        daemon.kill()
        daemon.wait()
        raise
    heading("6. stop the daemon")
    daemon.send_signal(signal.SIGTERM)
    try:
        status = daemon.wait(timeout=DAEMON_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        raise DemoFailed(f"ckptd did not exit within {DAEMON_STOP_TIMEOUT_S:.0f} s of SIGTERM") from None
    if status != 0:
        raise DemoFailed(f"ckptd exited with status {status} after SIGTERM, not 0")
    print("SIGTERM: ckptd drained its work and exited with status 0")


def wait_until_answering(daemon: subprocess.Popen[bytes], socket_path: Path) -> float:
    """Poll the daemon with a real RPC until it answers; return how long that took."""
    started = time.monotonic()
    while True:
        if daemon.poll() is not None:
            raise DemoFailed(f"ckptd exited with status {daemon.returncode} during start-up")
        # A fresh channel each time: a channel that failed once backs off before it reconnects.
        with ckpt.Checkpointer(job=JOB, address=str(socket_path)) as probe:
            try:
                probe.latest_step()
                return time.monotonic() - started
            except ckpt.DaemonUnavailable:
                pass
        if time.monotonic() - started > DAEMON_START_TIMEOUT_S:
            raise DemoFailed(f"ckptd did not answer on {socket_path} within {DAEMON_START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def train(args: list[str], *, kill_after_step: int | None = None) -> int | None:
    """Run the training script, echoing its progress; SIGKILL it once it reports kill_after_step, if given.

    Return the step after which the process was killed, or None when it ran to the end.
    """
    command = [sys.executable, "-u", str(TRAIN_SCRIPT), "--steps", str(STEPS), *args]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TRAIN_TIMEOUT_S, proc.kill)
    watchdog.start()
    killed_after = None
    pending = ""  # a shown step's line, held back until we know whether a checkpoint follows it
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            words = line.split() or [""]
            if words[0] == "checkpoint" and pending:
                print(f"{pending}   checkpoint saved, save_async returned in {words[4]} ms")
                pending = ""
                continue
            if pending:
                print(pending)
                pending = ""
            if words[0] == "step":
                step, loss = int(words[1]), float(words[3])
                shown = f"  step {step:>3}  loss {loss:.4f}"
                if kill_after_step is not None and step >= kill_after_step:
                    proc.send_signal(signal.SIGKILL)
                    killed_after = step
                    print(f"{shown}   SIGKILL -> training process {proc.pid}")
                    break
                if step % CKPT_EVERY == 0 or step == 1:
                    pending = shown
            elif words[0] == "resumed":
                print(f"  {line.strip()}: model, AdamW and RNG state loaded from ckptd")
            elif words[0] == "done":
                print(f"  {line.strip()}")
    finally:
        proc.stdout.close()
        status = proc.wait()
        watchdog.cancel()
    if pending:
        print(pending)
    if killed_after is not None:
        if status != -signal.SIGKILL:
            raise DemoFailed(f"training exited with status {status} before SIGKILL reached it")
        print(f"  training process died: {signal.Signals(-status).name}, exit status {status}")
        return killed_after
    if watchdog.finished.is_set() and status == -signal.SIGKILL:
        raise DemoFailed(f"training did not finish within {TRAIN_TIMEOUT_S:.0f} s")
    if status != 0:
        raise DemoFailed(f"training exited with status {status}")
    return None


def show_checkpoints(config: Path) -> None:
    """Print the daemon's table of complete steps."""
    command = [*ckptd_command(), "ls", "--config", str(config), "--job", JOB]
    print(f"$ ckptd ls --config {config} --job {JOB}")
    listing = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    if listing.returncode != 0:
        raise DemoFailed(f"ckptd ls exited with status {listing.returncode}: {listing.stderr.strip()}")
    print(listing.stdout.rstrip())


def read_losses(path: Path) -> dict[int, float]:
    """Read a {step: loss} JSON file written by the training script."""
    return {int(step): float(loss) for step, loss in json.loads(path.read_text()).items()}


def compare(reference: dict[int, float], resumed: dict[int, float], resumed_from: int) -> bool:
    """Print the losses after the resume beside the reference; return whether all are identical."""
    expected_steps = list(range(resumed_from + 1, STEPS + 1))
    if sorted(resumed) != expected_steps:
        print(f"the resumed run ran steps {sorted(resumed)}, expected {resumed_from + 1}..{STEPS}")
        return False
    print(f"  {'step':>4}  {'reference (uninterrupted)':>26}  {'resumed after SIGKILL':>26}")
    differing = 0
    for step in expected_steps:
        same = resumed[step] == reference[step]
        differing += not same
        mark = "" if same else "   <-- differs"
        print(f"  {step:>4}  {reference[step]!r:>26}  {resumed[step]!r:>26}{mark}")
    if differing:
        print(f"DIFFERENT: {differing} of {len(expected_steps)} losses after the resume differ from the reference")
        return False
    print(f"IDENTICAL: all {len(expected_steps)} losses after the resume equal the uninterrupted run bit for bit")
    return True


def run_demo(work_dir: Path, staging_dir: Path) -> bool:
    """Run every phase of the demo; return whether the resumed run matches the reference."""
    config = write_config(work_dir, staging_dir)
    socket_path = work_dir / "ckptd.sock"
    reference_path, resumed_path = work_dir / "reference.json", work_dir / "resumed.json"
    ckpt_args = ["--ckpt-every", str(CKPT_EVERY), "--job", JOB, "--address", str(socket_path)]

    heading("0. start the daemon")
    with running_daemon(config, socket_path, work_dir / "ckptd.log"):
        heading(f"1. reference run: {STEPS} steps, uninterrupted, no checkpoints")
        train(["--losses", str(reference_path)])

        heading(f"2. checkpointed run: save_async every {CKPT_EVERY} steps, SIGKILL after step {KILL_AFTER_STEP}")
        killed_after = train(ckpt_args, kill_after_step=KILL_AFTER_STEP)

        heading("3. the checkpoints ckptd holds")
        show_checkpoints(config)

        heading("4. resume: the same command again")
        with ckpt.Checkpointer(job=JOB, address=str(socket_path)) as c:
            resumed_from = c.latest_step()
        if resumed_from is None or killed_after is None or not CKPT_EVERY <= resumed_from <= killed_after:
            raise DemoFailed(f"latest checkpoint is step {resumed_from}, killed after step {killed_after}")
        print(f"  latest_step() = {resumed_from}; steps {resumed_from + 1}..{killed_after} are lost and redone")
        train([*ckpt_args, "--losses", str(resumed_path)])

        heading(f"5. compare the losses of steps {resumed_from + 1}..{STEPS} with the reference")
        identical = compare(read_losses(reference_path), read_losses(resumed_path), resumed_from)
    return identical


def main() -> int:
    """Run the demo in a fresh temporary directory and return its exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (config, NVMe tier, daemon log)")
    args = p.parse_args()

    started = time.monotonic()
    work_dir = Path(tempfile.mkdtemp(prefix="ckptd-demo-"))
    shm = Path("/dev/shm")
    staging_dir = (shm if shm.is_dir() else work_dir) / f"ckptd-demo-{os.getpid()}"
    print("ckptd demo: a tiny transformer trains, is killed with SIGKILL, and resumes from its checkpoint")
    print(f"working directory {work_dir}")
    try:
        identical = run_demo(work_dir, staging_dir)
    except DemoFailed as e:
        print(f"\ndemo FAILED: {e}", file=sys.stderr)
        log = work_dir / "ckptd.log"
        if log.exists():
            print("last lines of the daemon's log:", file=sys.stderr)
            print("\n".join(log.read_text(errors="replace").splitlines()[-20:]), file=sys.stderr)
        identical = False
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
        if args.keep:
            print(f"kept {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(f"\ndemo {'passed' if identical else 'FAILED'} in {time.monotonic() - started:.1f} s")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
