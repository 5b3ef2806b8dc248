"""Run a real `ckptd serve` for a benchmark: its config, readiness, status, resources and shutdown.

Every benchmark that needs a daemon uses BenchDaemon: launch() (or start(), which
also waits), then its measurements, then stop() for the warnings the daemon logged,
and kill() on the way out of a failed run. Run as scripts, benchmarks import it
from this directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.transport import DaemonClient
from ckpt_core.wire.v1 import ckptd_pb2 as pb

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 600.0  # a drain may flush gigabytes
STATUS_TIMEOUT_S = 120.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """Return a loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_env() -> dict[str, str]:
    """Return the daemon's environment: this one's, PYTHONPATH (which code it runs) included, less CKPTD_*."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}


@dataclass
class BenchDaemon:
    """One `ckptd serve` process, with its root, socket and log under work and its staging slots in staging."""

    name: str
    work: Path
    staging: Path
    listen: str = ""  # [node] listen: the peer endpoint, if any
    toml: str = ""  # more of the config, other sections than [node] and [staging]
    root_parent: Path | None = None  # where the root goes instead of work (another "disk")
    cpus: set[int] = field(default_factory=set)  # the CPUs it may run on; empty: any
    program: tuple[str, ...] = ("-m", "ckptd")  # what the interpreter runs, then `serve --config ...`
    env: dict[str, str] = field(default_factory=dict)  # more of its environment
    wrapper: tuple[str, ...] = ()  # a command that runs the rest of its line, e.g. `ip netns exec NS` (a host's)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        return self.work / "d.sock"

    @property
    def root(self) -> Path:
        return (self.root_parent or self.work) / "root"

    @property
    def log_path(self) -> Path:
        return self.work / "ckptd.log"

    def launch(self) -> socket.socket:
        """Write the config and start `ckptd serve`; return the socket on which it will say READY=1."""
        config = self.work / "ckptd.toml"
        # json.dumps quotes a string the way a TOML basic string wants it.
        config.write_text(
            f"[node]\nname = {json.dumps(self.name)}\nroot = {json.dumps(str(self.root))}\n"
            f"socket = {json.dumps(str(self.socket_path))}\nlisten = {json.dumps(self.listen)}\n\n"
            f"[staging]\ndir = {json.dumps(str(self.staging))}\n\n{self.toml}"
        )
        notify_path = self.work / "notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        cpus = self.cpus
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.wrapper, sys.executable, *self.program, "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**daemon_env(), **self.env, "NOTIFY_SOCKET": str(notify_path)},
                cwd=self.work,  # `python -m` puts the working directory first: a checkout there would win
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        return notify

    def wait_ready(self, notify: socket.socket) -> None:
        """Return once the daemon has said READY=1 on notify (then closed); raise if it exits or never does."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        with notify:
            notify.settimeout(0.5)  # so that a daemon that exits at start-up is noticed
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ckptd {self.name} exited with {self.proc.returncode}:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ckptd {self.name} not ready in {READY_TIMEOUT_S} s:\n{self.log()}")
                try:
                    message = notify.recv(4096).decode()
                except TimeoutError:
                    continue
                if "READY=1" in message.split("\n"):
                    return

    def start(self) -> BenchDaemon:
        """Launch the daemon and return once it is ready."""
        self.wait_ready(self.launch())
        return self

    def client(self) -> DaemonClient:
        return DaemonClient(str(self.socket_path))

    def status(self) -> dict[str, Any]:
        """Return the daemon's status document (what `ckptd status --json` prints)."""
        client = self.client()
        try:
            return json.loads(client.call("Status", pb.StatusRequest(), timeout_s=STATUS_TIMEOUT_S).json)
        finally:
            client.close()

    def cpu_s(self) -> float:
        """Return the CPU seconds (user + system) the daemon has used so far."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S  # utime, stime

    def memory(self) -> dict[str, int]:
        """Return the daemon's resident memory (VmRSS and its parts, in bytes), threads and open files."""
        assert self.proc is not None
        found = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                found[name] = int(value.split()[0]) << 10
            elif name == "Threads":
                found[name] = int(value)
        found["open_fds"] = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        return found

    def log(self) -> str:
        """Return the end of the daemon's log."""
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def stop(self) -> list[str]:
        """Send SIGTERM, wait for the daemon to drain and exit; return the warnings and errors it logged."""
        if self.proc is None:
            return []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.returncode != 0:
            print(f"warning: ckptd {self.name} exited with {self.proc.returncode}:\n{self.log()}", file=sys.stderr)
        return self.logged()

    def logged(self) -> list[str]:
        """Return the warnings and errors the daemon logged so far."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return [f"{self.name}: {line}" for line in lines if " WARNING " in line or " ERROR " in line]

    def kill(self) -> None:
        """Kill the daemon if it still runs (the way out of a failed run)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
