"""Fixtures shared by every test: real ckptd processes in temporary places."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

READY_TIMEOUT_S = 30.0
SHARED_MEMORY = Path("/dev/shm")
OUR_SHARED_MEMORY_PREFIXES = ("ckptd-", "ckpt-")  # staging directories of daemons, tests and benchmarks
S3_KEY = "ckptd-test"  # moto takes any credentials
CKPTD = [sys.executable, "-m", "ckptd"]
DAEMON_STAGING_PREFIX = "ckptd-test-"
daemon_staging_made: set[str] = set()  # this run's: another run on the machine makes names of this prefix too
# Importing torch's inductor config (torchtitan does, where triton is installed) makes its cache directory,
# /tmp/torchinductor_<user> unless told: this run's goes into a directory of its own, removed when pytest
# exits (also when it stops before any test, on a path not found), and the processes the tests start inherit
# it. Made once: this module is imported again as `conftest` by the tests that take helpers from it, and a
# cache directory set by the user is theirs.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ckt-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def _our_shared_memory() -> set[str]:
    """Name the staging directories in /dev/shm this run may have made (another run's test daemons are not ours)."""
    if not SHARED_MEMORY.is_dir():
        return set()
    names = {p.name for p in SHARED_MEMORY.iterdir() if p.name.startswith(OUR_SHARED_MEMORY_PREFIXES)}
    return {n for n in names if not n.startswith(DAEMON_STAGING_PREFIX) or n in daemon_staging_made}


@pytest.fixture(scope="session", autouse=True)
def temporary_root_removed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Remove this run's temporary root (pytest's basetemp) at its end, failed tests' directories too.

    Only this run's: pytest's own "none" policy leaves the run's directory unlocked, and the
    first run to end would remove the directories of another run still going.
    """
    root = tmp_path_factory.getbasetemp()
    yield
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def shared_memory_left_as_found() -> Iterator[None]:
    """Fail the run if it leaves a staging directory of ours in /dev/shm: that is RAM, and nobody else frees it."""
    before = _our_shared_memory()
    yield
    left = sorted(_our_shared_memory() - before)
    assert not left, f"the tests left these in {SHARED_MEMORY}: {left}"


class Daemon:
    """One real `ckptd serve` process with its own root, staging dir and socket."""

    def __init__(self, base: Path, extra_toml: str = "", root: Path | None = None, listen: str = "") -> None:
        self.base = base
        self.root = root or base / "nvme"
        self.socket = base / "d.sock"
        self.staging_dir = SHARED_MEMORY / f"{DAEMON_STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
        daemon_staging_made.add(self.staging_dir.name)
        self.config_path = base / "ckptd.toml"
        # Every step flushed ([nvme] flush_every = 1), as the tests written before saves could outrun the
        # disk expect; the tests of passing over set CKPTD_NVME__FLUSH_EVERY (env overrides the file).
        self.config_path.write_text(
            f'[node]\nroot = "{self.root}"\nsocket = "{self.socket}"\nlisten = "{listen}"\n'
            "[nvme]\nflush_every = 1\n"
            f'[staging]\ndir = "{self.staging_dir}"\n' + extra_toml
        )
        self.log_path = base / "ckptd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.listen = listen  # the peer address, for daemons of a cluster
        self.serve_args: list[str] = []  # more flags for `ckptd serve`
        self.wrapper: list[str] = []  # a command that runs the rest of its line (`ckptd serve`), e.g. in a namespace
        self.host = None  # its Host, where it runs in a network namespace of its own (make_host_cluster)
        self.env: dict[str, str] = {}  # more environment for `ckptd serve` (CKPTD_<SECTION>__<KEY> overrides)

    @property
    def address(self) -> str:
        return str(self.socket)

    def start(self) -> Daemon:
        """Start serving and return once the daemon has said READY=1 over the notify protocol."""
        notify_path = self.base / "notify.sock"
        notify_path.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(str(notify_path))
            notify.settimeout(READY_TIMEOUT_S)
            env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(notify_path)}
            env.pop("CKPTD_ADDRESS", None)
            log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
            self.proc = subprocess.Popen(
                [*self.wrapper, *CKPTD, "serve", "--config", str(self.config_path), *self.serve_args],
                stderr=log,
                env=env,
            )
            log.close()
            while True:
                try:
                    message = notify.recv(4096).decode()
                except TimeoutError:
                    raise AssertionError(f"ckptd did not become ready:\n{self.log()}") from None
                if "READY=1" in message.split("\n"):
                    return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the daemon, as a crash would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        """SIGTERM the daemon and return its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a ckptd command against this daemon's config."""
        return subprocess.run(
            [*CKPTD, *args, "--config", str(self.config_path)], capture_output=True, text=True, timeout=120
        )

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def lose(self) -> None:
        """Kill the daemon and wipe its NVMe root and shared memory, as losing the node would."""
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)


def free_port() -> int:
    """Return a loopback port that was free a moment ago (chosen at run time, never fixed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Yield a short temporary directory (unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ckt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_disk(short_tmp: Path) -> Iterator[Path]:
    """Yield a directory on an 8 MiB tmpfs of its own (a disk a test can fill); skip where mounting needs root."""
    small = short_tmp / "small"
    small.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(small)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small filesystem here (needs root)")
    try:
        yield small
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


@pytest.fixture
def read_only_dir(short_tmp: Path) -> Iterator[Path]:
    """Yield a directory nothing can be written in: a read-only tmpfs where we are root (permission bits do not
    stop root), else one without write permission; skip where root cannot mount one."""
    path = short_tmp / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0755", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("root cannot mount a read-only filesystem here, and nothing else stops root writing")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def make_daemon(short_tmp: Path) -> Iterator:
    """Return a factory of daemons (not started), each in its own directory, all killed at the end."""
    daemons: list[Daemon] = []

    def make(extra_toml: str = "", name: str = "", root: Path | None = None, listen: str = "") -> Daemon:
        base = short_tmp / (name or f"d{len(daemons)}")
        base.mkdir()
        daemons.append(Daemon(base, extra_toml, root, listen))
        return daemons[-1]

    yield make
    for d in daemons:
        d.cleanup()
        print(f"--- log of {d.base.name} ---\n{d.log()[-6000:]}")  # pytest shows it when the test failed


@pytest.fixture
def cluster_backend() -> str:
    """The [cluster] backend make_cluster's daemons use; a test module parametrizes it to run on both."""
    return "peers"


@pytest.fixture
def make_cluster(make_daemon, cluster_backend, request) -> Iterator:
    """Return a factory of n daemons (not started) that are each other's peers on loopback ports.

    Every node gets the same [peer] addresses list, its own address included (a node skips it).
    With cluster_backend "etcd", they keep the cluster view in a real etcd server of the test's own.
    """
    cluster = ""
    if cluster_backend == "etcd":
        etcd = request.getfixturevalue("etcd_server")
        cluster = f'[cluster]\nbackend = "etcd"\nendpoints = ["{etcd.endpoint}"]\nlease_ttl_s = 3\n'

    def make(n: int, replicas: int = 1, extra_toml: str = "", tls: list[tuple[Path, Path, Path]] | None = None):
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        peers = ", ".join(f'"{a}"' for a in addresses)
        nodes = []
        for i, address in enumerate(addresses):
            toml = cluster + f"[peer]\naddresses = [{peers}]\nreplicas = {replicas}\n"
            if tls is not None:
                cert, key, ca = tls[i]
                toml += f'cert = "{cert}"\nkey = "{key}"\nca = "{ca}"\n'
            else:
                toml += "insecure = true\n"  # plaintext on loopback, said explicitly (the TLS tests pass tls)
            nodes.append(make_daemon(toml + extra_toml, name=f"n{i}", listen=address))
        return nodes

    return make


@pytest.fixture
def network() -> Iterator:
    """Yield a Network of the test's own (tests/netns.py), removed at the end; skip where namespaces are refused."""
    from netns import NamespacesRefused, Network

    try:
        net = Network()
    except NamespacesRefused as e:
        pytest.skip(f"no network namespaces here: {e}")
    try:
        yield net
    finally:
        net.close()


HOST_PEER_PORT = 7070  # every daemon's peer port in its own namespace, where nothing else can hold it


@pytest.fixture
def make_host_cluster(make_daemon, network) -> Iterator:
    """Return a factory of n daemons (not started), each on a host of its own (network), each other's peers.

    Like make_cluster, but a daemon's peer address is its host's, on a link the test can cut
    (network.cut, cut_one_way, isolate, heal); node.host is its Host. Clients and the CLI reach a
    daemon by its unix socket, which no cut touches. Its daemons are killed before the network goes.
    """
    nodes = []

    def make(n: int, replicas: int = 1, extra_toml: str = ""):
        hosts = [network.host(f"n{len(nodes) + i}") for i in range(n)]
        peers = ", ".join(f'"{h.address}:{HOST_PEER_PORT}"' for h in hosts)
        made = []
        for host in hosts:
            toml = f"[peer]\naddresses = [{peers}]\nreplicas = {replicas}\ninsecure = true\n" + extra_toml
            node = make_daemon(toml, name=host.name, listen=f"{host.address}:{HOST_PEER_PORT}")
            node.wrapper = host.command()
            node.host = host
            made.append(node)
        nodes.extend(made)
        return made

    yield make
    for node in nodes:
        node.cleanup()


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    """Yield one started daemon."""
    return make_daemon().start()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator:
    """A one-rank gloo process group (a file store: no port) and a 1-D device mesh over it, for a test module."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def eventually(condition, timeout_s: float = 60.0, what: str = "the condition") -> None:
    """Wait for a condition that background work makes true (catch-up rounds, retries), up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s} s"
        time.sleep(0.2)


class S3Server:
    """A real S3 endpoint over HTTP on loopback: moto's server process, on a port chosen at run time."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        ready = threading.Event()
        threading.Thread(target=self._drain_log, args=(log_path, ready), daemon=True).start()
        if not ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError(f"moto server did not start: {log_path.read_text(errors='replace')}")

    def _drain_log(self, log_path: Path, ready: threading.Event) -> None:
        assert self.proc.stderr is not None
        with open(log_path, "ab") as log:
            for line in self.proc.stderr:  # werkzeug says where it listens once the socket is bound
                log.write(line)
                log.flush()
                if b"Running on" in line:
                    ready.set()
        ready.set()  # exited: the caller looks at why

    @property
    def storage_options(self) -> dict:
        return {"key": S3_KEY, "secret": S3_KEY, "client_kwargs": {"endpoint_url": self.endpoint}}

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_KEY,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        """Create a bucket no other test uses and return its name."""
        name = f"ckpt-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def toml(self, url: str, extra: str = "") -> str:
        """Return an [object] section for url on this endpoint."""
        return (
            f'[object]\nurl = "{url}"\n{extra}'
            f'storage_options = {{key = "{S3_KEY}", secret = "{S3_KEY}", '
            f'client_kwargs = {{endpoint_url = "{self.endpoint}"}}}}\n'
        )

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """Yield one moto S3 server for the session; each test makes its own bucket."""
    server = S3Server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def own_s3_server(tmp_path) -> Iterator[S3Server]:
    """Yield an S3 server for one test alone (one it may stop and continue)."""
    server = S3Server(tmp_path / "moto.log")
    yield server
    server.proc.send_signal(signal.SIGCONT)
    server.stop()


@pytest.fixture
def etcd_server(tmp_path) -> Iterator:
    """Yield a started etcd server of the test's own (tests/etcd_server.py), ended when the test ends."""
    from etcd_server import EtcdServer

    with EtcdServer(tmp_path / "etcd") as server:
        yield server
