"""Benchmark replication to a peer against a raw loopback socket transfer of the same bytes, in one run.

Two real `ckptd serve` processes, A and B, are each other's peers on loopback ports. A state of one
tensor is saved through A; once it is durable on A's NVMe, A sends it to B, and A's status says how
long that took (`tiers.peer.last_transfer`). Interleaved with each save, the same bytes go over a
plain TCP socket on 127.0.0.1 to a child process, once into memory (the limit of the design's
target) and once also written to a file with O_DIRECT and fsynced (as B makes its replica durable).
It prints a table and writes JSON; it is not a test. See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_peer.py --size-mib 512 --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import multiprocessing
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import ckpt
import torch
import xxhash
from ckpt_core.format import ShardMeta, data_name, meta_name
from daemon import BenchDaemon, free_port
from report import (  # benchmarks/report.py: run as scripts, this directory is on sys.path
    Row,
    held,
    table,
    write_results,
)

from ckptd.cluster.data_channel import client_context
from ckptd.cluster.peer_link import STREAMS_PER_SHARD, PeerLink
from ckptd.config import PeerConfig
from ckptd.rpc.data_listener import server_context

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DIRECT_IO_ALIGN_BYTES = 4096
DISK_BLOCK_BYTES = 8 << 20  # the receiver's write size, as ckptd's receiver writes
CHUNK_BYTES = 4 << 20  # checked one by one, as ckptd checks them
DISK_THREADS = 4
RECV_BYTES = 4 << 20  # the most one recv_into asks for
WAIT_TIMEOUT_S = 600.0
WARMUP_SAVES = 2
TARGET = ">= 0.8"
JOB = "bench-peer"


# -- the daemons --------------------------------------------------------------------------


def peer_config(tls: Path | None, data_channel: bool) -> PeerConfig:
    """Return the [peer] settings both nodes and the raw socket use: TLS with certificates from tls/, or plaintext."""
    if tls is None:  # plaintext on loopback, said explicitly
        return PeerConfig(insecure=True, data_channel=data_channel)
    # The test suite's certificate maker (it needs cryptography, as --tls alone does), loaded by path: tests/ on
    # sys.path would also put tests/ckptd there, which spawned children take for the package.
    spec = importlib.util.spec_from_file_location("certs", Path(__file__).resolve().parents[1] / "tests" / "certs.py")
    assert spec is not None and spec.loader is not None
    certs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(certs)
    ca = certs.CertificateAuthority(tls)
    cert, key = ca.issue("node")  # one certificate for both nodes: both are 127.0.0.1
    return PeerConfig(cert=str(cert), key=str(key), ca=str(ca.ca_path), data_channel=data_channel)


def peer_toml(peer: str, config: PeerConfig) -> str:
    """Return the rest of a node's config: the other node as its one peer, and short retention."""
    settings = {"addresses": [peer], "replicas": 1, "data_channel": config.data_channel}
    if config.cert:
        settings |= {"cert": config.cert, "key": config.key, "ca": config.ca}
    else:
        settings["insecure"] = True
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    return "[peer]\n" + "\n".join(lines) + "\n\n[retention]\nnvme = 2\npeer = 2\n"


# -- the raw socket limit ------------------------------------------------------------------


def _receive(conn: socket.socket, view: memoryview, size_bytes: int, path: str) -> None:
    """Receive size_bytes from conn into view; with a path, also check and write them there durably as they come.

    DISK_THREADS writer threads follow the receive block by block, compute the xxh3-128
    of each 4 MiB chunk and write it (O_DIRECT where the filesystem allows), so writing
    overlaps receiving and does the same work as ckptd's receiver; the file is fsynced.
    """
    blocks: queue.Queue[tuple[int, int] | None] = queue.Queue()
    errors: list[OSError] = []
    direct = True
    fd = -1
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:  # tmpfs (--peer-disk memory) takes no O_DIRECT
            direct, fd = False, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_blocks() -> None:
        while (block := blocks.get()) is not None:
            offset, n = block
            for lo in range(offset, offset + n, CHUNK_BYTES):
                xxhash.xxh3_128_hexdigest(view[lo : min(offset + n, lo + CHUNK_BYTES)])
            padded = -(-n // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES if direct else n  # the buffer is padded
            try:
                if os.pwrite(fd, view[offset : offset + padded], offset) != padded:
                    raise OSError(f"short direct write to {path}")
            except OSError as e:
                errors.append(e)

    writers = [threading.Thread(target=write_blocks) for _ in range(DISK_THREADS if path else 0)]
    for w in writers:
        w.start()
    try:
        got, queued = 0, 0
        while got < size_bytes:
            n = conn.recv_into(view[got : min(size_bytes, got + RECV_BYTES)])
            if n == 0:
                raise ConnectionError(f"the sender stopped after {got} of {size_bytes} bytes")
            got += n
            while path and (got - queued >= DISK_BLOCK_BYTES or got == size_bytes > queued):
                blocks.put((queued, min(DISK_BLOCK_BYTES, got - queued)))
                queued += DISK_BLOCK_BYTES
    finally:
        for _ in writers:
            blocks.put(None)
        for w in writers:
            w.join()
    if errors:
        raise errors[0]
    if path:
        os.ftruncate(fd, size_bytes)  # direct writes pad the last block
        os.fsync(fd)
        os.close(fd)


def _receiver(control: Connection, listener: socket.socket, size_bytes: int, peer: PeerConfig) -> None:
    """Serve transfers in a child process: for each request on control, take one connection's bytes.

    A request is a file path ("" for memory only), None to stop. The bytes go into one
    preallocated, already touched buffer; the one-byte acknowledgement goes back once
    they are all in (and durable, with a path).
    """
    buffer = mmap.mmap(-1, -(-size_bytes // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES)
    buffer.write(b"\x5a" * len(buffer))
    view = memoryview(buffer)
    tls = server_context(peer)  # TLS as the daemons speak it, where they do
    while (path := control.recv()) is not None:
        control.send("ready")
        accepted, _ = listener.accept()
        with tls.wrap_socket(accepted, server_side=True) if tls else accepted as conn:
            _receive(conn, view, size_bytes, path)
            conn.sendall(b"\x01")
        if path:
            os.unlink(path)
        control.send(size_bytes)


class RawSocket:
    """A child process that receives over TCP on 127.0.0.1 (TLS where peer says); the parent sends and times it."""

    def __init__(self, size_bytes: int, peer: PeerConfig) -> None:
        self.size_bytes = size_bytes
        self._tls = client_context(peer)
        # What we send: preallocated and touched, so no page fault is timed.
        self._data = mmap.mmap(-1, size_bytes)
        block = os.urandom(RECV_BYTES)
        for offset in range(0, size_bytes, RECV_BYTES):
            self._data.write(block[: size_bytes - offset])
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._control, child = multiprocessing.get_context("spawn").Pipe()
        self._proc = multiprocessing.get_context("spawn").Process(
            target=_receiver, args=(child, self._listener, size_bytes, peer), daemon=True
        )
        self._proc.start()
        self._listener.close()  # the child holds it now

    def transfer(self, path: Path | None = None) -> float:
        """Send every byte, from connect to the receiver's one-byte acknowledgement; return the seconds."""
        self._control.send(str(path) if path else "")
        if self._control.recv() != "ready":
            raise RuntimeError("the raw socket receiver did not get ready")
        start = time.perf_counter()
        with socket.create_connection(self.address) as conn:
            s = self._tls.wrap_socket(conn, server_hostname=self.address[0]) if self._tls else conn
            s.sendall(self._data)
            if s.recv(1) != b"\x01":
                raise ConnectionError("the raw socket receiver did not acknowledge")
        elapsed = time.perf_counter() - start
        if self._control.recv() != self.size_bytes:
            raise RuntimeError("the raw socket receiver lost bytes")
        return elapsed

    def close(self) -> None:
        """Stop the child."""
        if self._proc.is_alive():
            self._control.send(None)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._data.close()


# -- the run ---------------------------------------------------------------------------------


def replicate_alone(a: BenchDaemon, b: BenchDaemon, step: int, peer: PeerConfig) -> tuple[float, float, float]:
    """Send a step of A to B once more with ckptd's own sender, nothing else running.

    Return the seconds, and the CPU seconds of each side: the sender is this process (its
    other threads idle meanwhile), the receiver B's daemon.

    The daemon starts a replica beside its NVMe flush, so on a small machine the two share
    the CPUs and, here, the one disk; this times the protocol and B's receiver alone. The
    bytes are sent from a copy in memory (A's staging directory, a tmpfs), as the raw socket
    sends them and as the daemon does while the staging slot holds the snapshot: read from
    A's NVMe on the disk B writes to, the read alone took most of the time. The copy goes in
    as another step (1000000 + step) of a second job, which B's retention then removes.
    """
    step_dir = a.root / JOB / str(step)
    meta = ShardMeta.from_bytes((step_dir / meta_name(0)).read_bytes(), "A's shard record")
    alone = ShardMeta(**{**meta.__dict__, "job": JOB + "-alone", "step": 1_000_000 + step})
    in_memory = a.staging / "replicate-alone.data"
    shutil.copyfile(step_dir / data_name(0), in_memory)
    link = PeerLink(b.listen, peer)
    try:
        with ThreadPoolExecutor(max_workers=STREAMS_PER_SHARD) as streams:
            start, cpu_sender, cpu_receiver = time.perf_counter(), time.process_time(), b.cpu_s()
            link.put_shard(alone, in_memory, streams)
            elapsed = time.perf_counter() - start
            return elapsed, time.process_time() - cpu_sender, b.cpu_s() - cpu_receiver
    finally:
        link.close()
        in_memory.unlink()


def replicate(
    c: ckpt.Checkpointer, a: BenchDaemon, b: BenchDaemon, state: dict[str, torch.Tensor], step: int
) -> dict[str, float]:
    """Save one step through A, wait for "nvme" then "peer"; return the timings and A's account of the transfer."""
    before = a.status()["tiers"]["peer"]["counters"]
    start = time.perf_counter()
    handle = c.save_async(state, step=step)
    returned = time.perf_counter()
    handle.wait("nvme", timeout=WAIT_TIMEOUT_S)
    on_nvme = time.perf_counter()
    cpu_a, cpu_b = a.cpu_s(), b.cpu_s()
    handle.wait("peer", timeout=WAIT_TIMEOUT_S)
    on_peer = time.perf_counter()
    cpu_a, cpu_b = a.cpu_s() - cpu_a, b.cpu_s() - cpu_b
    peer = a.status()["tiers"]["peer"]
    sent = peer["counters"]["replicas_sent"] - before["replicas_sent"]
    failures = peer["counters"]["replica_failures"] - before["replica_failures"]
    if sent != 1:
        raise RuntimeError(f"step {step}: A sent {sent} replicas, expected 1 (status: {peer})")
    return {
        "replication": peer["last_transfer"]["seconds"],
        "replica_bytes": peer["last_transfer"]["bytes"],
        "replica_failures": failures,
        "save_block": returned - start,
        "save_to_nvme": on_nvme - start,
        "save_to_peer": on_peer - start,
        "nvme_to_peer": on_peer - on_nvme,
        "cpu_a_nvme_to_peer": cpu_a,
        "cpu_b_nvme_to_peer": cpu_b,
    }


def bench(
    state: dict[str, torch.Tensor], a: BenchDaemon, b: BenchDaemon, peer: PeerConfig, repeats: int
) -> tuple[int, dict[str, list[float]], dict[str, Any]]:
    """Replicate each step interleaved with raw socket transfers of the same bytes.

    Return the replica's size, the raw timings, and A's peer tier status at the end.
    """
    raw: dict[str, list[float]] = defaultdict(list)
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=str(a.socket_path)) as c:
        for step in range(WARMUP_SAVES):
            size = int(replicate(c, a, b, state, step)["replica_bytes"])
        sockets = RawSocket(size, peer)
        try:
            sockets.transfer()  # warm up the child and the socket path
            for step in range(WARMUP_SAVES, WARMUP_SAVES + repeats):
                raw["raw_socket"].append(sockets.transfer())
                # Where B keeps its replicas: the same disk (or, with --peer-disk memory, tmpfs).
                raw["raw_socket_durable"].append(sockets.transfer(b.root.parent / "raw-socket.bin"))
                for key, value in replicate(c, a, b, state, step).items():
                    raw[key].append(value)
                seconds, cpu_sender, cpu_receiver = replicate_alone(a, b, step, peer)
                raw["replication_alone"].append(seconds)
                raw["cpu_sender_alone"].append(cpu_sender)
                raw["cpu_receiver_alone"].append(cpu_receiver)
                print(
                    f"  step {step}: replication {raw['replication'][-1]:.3f} s, raw socket "
                    f"{raw['raw_socket'][-1]:.3f} s, checked durable {raw['raw_socket_durable'][-1]:.3f} s",
                    flush=True,
                )
        finally:
            sockets.close()
    if any(n != size for n in raw["replica_bytes"]):
        raise RuntimeError(f"replicas of different sizes: {raw['replica_bytes']}")
    peer = a.status()["tiers"]["peer"]
    if peer["counters"]["replicas_sent"] != WARMUP_SAVES + repeats:
        # A replica sent again (between the timed steps) competed with the raw socket for the machine.
        print(f"warning: A sent {peer['counters']['replicas_sent']} replicas for {WARMUP_SAVES + repeats} saves")
    last = WARMUP_SAVES + repeats - 1
    replica = ckpt.load_local(b.root / ".peer" / JOB / str(last))
    if replica.keys() != state.keys() or not all(torch.equal(replica[k], state[k]) for k in state):
        raise RuntimeError("the replica on B is not the saved state bit for bit")
    return size, dict(raw), peer


def build_rows(size: int, raw: dict[str, list[float]]) -> list[Row]:
    """Turn raw timings into table rows: ours held against the raw socket, and against the durable one."""
    best = {k: min(v) for k, v in raw.items()}
    median = {k: statistics.median(v) for k, v in raw.items()}
    rows = [
        Row("raw socket (limit)", best["raw_socket"], size),
        Row("raw socket + checksums + write + fsync", best["raw_socket_durable"], size),
    ]
    limits = (("raw socket", best["raw_socket"]), ("raw + durable", best["raw_socket_durable"]))
    for key, what in (("replication", "replication to peer"), ("replication_alone", "replication alone")):
        for limit, limit_s in limits:
            for label, stat in (("best", best), ("median", median)):
                t = stat[key]
                rows.append(held(f"{what} ({label})", t, size, limit, limit_s / t, TARGET))
    for key, what in (
        ("save_to_nvme", "save -> nvme, as seen by the user"),
        ("save_to_peer", "save -> peer, as seen by the user"),
        ("nvme_to_peer", "nvme -> peer, as seen by the user"),
    ):
        rows.append(Row(f"{what} (median)", median[key], size))
    return rows


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512, help="size of the state in MiB (default 512)")
    p.add_argument("--repeats", type=int, default=5, help="timed replications (default 5)")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where to write, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "peer.json", help="where to write the results")
    p.add_argument(
        "--peer-disk",
        choices=["same", "memory"],
        default="same",
        help="where B keeps its data: on the disk under test beside A's (default), or in /dev/shm, standing in for "
        "a peer node with a disk of its own (this VM has one disk for both 'nodes')",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="peers speak TLS with client certificates (made for the run), and so does the raw socket",
    )
    p.add_argument(
        "--no-data-channel",
        action="store_true",
        help="replicas' bytes go in gRPC PutShard streams ([peer] data_channel = false), as before the data channel",
    )
    return p.parse_args()


def main() -> int:
    """Start the two daemons, run every measurement, print the table and write the JSON."""
    args = parse_args()
    generator = torch.Generator().manual_seed(0)
    state = {"weight": torch.randn(args.size_mib << 18, dtype=torch.float32, generator=generator)}
    load_before = os.getloadavg()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-peer-", dir=args.dir))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-bench-peer-", dir="/dev/shm"))
    print(
        f"one tensor of {args.size_mib} MiB; {'TLS' if args.tls else 'plaintext'}, "
        f"{'gRPC streams' if args.no_data_channel else 'data channel'}; working in {work}, staging in {staging}",
        flush=True,
    )
    a_listen, b_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    peer = peer_config(work / "tls" if args.tls else None, data_channel=not args.no_data_channel)
    a = BenchDaemon("a", work / "a", staging / "a", a_listen, peer_toml(b_listen, peer))
    b_disk = staging / "b-disk" if args.peer_disk == "memory" else None
    b = BenchDaemon("b", work / "b", staging / "b", b_listen, peer_toml(a_listen, peer), root_parent=b_disk)
    daemon_warnings: list[str] = []
    try:
        for node in (a, b):
            node.work.mkdir()
            node.staging.mkdir()
        try:
            # Both start before either is waited for, so neither asks a peer that is not there yet.
            notify_a, notify_b = a.launch(), b.launch()
            a.wait_ready(notify_a)
            b.wait_ready(notify_b)
            size, raw, peer_status = bench(state, a, b, peer, args.repeats)
        finally:
            for node in (a, b):
                daemon_warnings += node.stop()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = build_rows(size, raw)
    print()
    print(table(rows))
    cpu = {k: statistics.median(raw[f"cpu_{k}_nvme_to_peer"]) for k in ("a", "b")}
    print(
        f"\nCPU seconds used between nvme and peer (median): sender A {cpu['a']:.2f}, receiver B {cpu['b']:.2f}; "
        f"the shard's bytes, {size} in all, were {size / args.size_mib / (1 << 20):.4f}x the tensor"
    )
    per_gb = {k: statistics.median(raw[f"cpu_{k}_alone"]) / (size / 1e9) for k in ("sender", "receiver")}
    print(
        f"CPU seconds per GB replicated, replication alone (median): sender {per_gb['sender']:.3f}, "
        f"receiver {per_gb['receiver']:.3f}"
    )
    print("\nckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(
        args.json,
        load_before,
        rows,
        {"torch": torch.__version__},
        size_bytes=size,
        repeats=args.repeats,
        tls=args.tls,
        data_channel=not args.no_data_channel,
        dir=str(args.dir.resolve()),
        raw_s=raw,
        peer_status_of_a=peer_status,
        daemon_warnings=daemon_warnings,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
