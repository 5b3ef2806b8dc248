"""Run the daemon: bind the unix socket, serve RPCs, stop cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from ckpt_core.daemon_socket import MAX_MESSAGE_BYTES
from ckpt_core.wire.v1 import ckptd_pb2_grpc

from ckptd import metrics, sd_notify
from ckptd.addresses import host_of
from ckptd.cluster.peer_link import server_credentials, server_options
from ckptd.cluster.peers_view import PeersView
from ckptd.config import Config, ConfigError
from ckptd.errors import RootGone
from ckptd.log_pace import LogPace
from ckptd.node import Executors, Node
from ckptd.operations import root_lock
from ckptd.operations.status import StatusReport
from ckptd.rpc.cluster_server import add_cluster_servicer
from ckptd.rpc.data_listener import DataListener
from ckptd.rpc.grpc_log import CoreLog
from ckptd.rpc.guard import RequestGuard
from ckptd.rpc.peer_server import PeerServicer, add_peer_servicer
from ckptd.rpc.server import CkptdServicer
from ckptd.storage.owned_dir import DIR_MODE, claim_dir

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"  # asyncio's message (selector_events)
MAX_PEER_RPCS = 64  # calls from peers served at once; more are refused (RESOURCE_EXHAUSTED) and retried


class AlreadyServing(Exception):
    """Another daemon answers on the configured socket."""


class ListenFailed(Exception):
    """The socket, the peer or the metrics endpoint could not be taken."""


async def serve(config: Config) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight flushes and return.

    Raises RootGone, after giving the staging memory back and stopping the same way, when
    the NVMe root is removed or replaced under the daemon: its view of the steps is void;
    RootInUse when another daemon holds the NVMe root (root_lock), UnsafePath when the socket's, the root's or the
    staging directory could have been prepared by another user (owned_dir), InvalidArgument naming
    node.root when it cannot be written, and ConfigError when node.cpus names CPUs it may not run on.
    """
    core_log = CoreLog()  # gRPC's C core writes to stderr: its failed TLS handshakes come into our log, readable
    core_log.start()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_paced_accept_failures(LogPace()))
    executors = Executors.build()  # every thread pool of the daemon (threads start on first use)
    loop.set_default_executor(executors.resolve)  # asyncio's own name lookups (a listen address by name)
    try:
        _claim_socket(config.socket_path)
        # Before anything touches the root: another daemon's start-up cleanup and retention would undo ours.
        lock = await loop.run_in_executor(executors.peer, root_lock.hold, config.root, config.socket_path)
        try:
            await _serve_holding_root(config, executors)
        finally:
            lock.release()
    finally:
        executors.shutdown()  # Node.drain did, unless the daemon stopped before or while starting
        core_log.stop()


async def _serve_holding_root(config: Config, executors: Executors) -> None:
    if config.cpu_set:
        _pin(config.cpu_set)  # before the node starts its threads: they inherit it
    node = Node(config, executors)  # every role of the daemon
    await node.start()
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    guard = RequestGuard()
    servicer = CkptdServicer(
        node.save_path, node.locator, node.sharded_reads, node.retention, node.job_removal, node.report, guard
    )
    guard.register(ckptd_pb2_grpc.add_CkptdServicer_to_server, servicer, server)
    server.add_insecure_port(f"unix:{config.socket_path}")
    old_umask = os.umask(0o117)  # the socket is born owner/group only: no moment where others may connect
    try:
        await server.start()
    finally:
        os.umask(old_umask)
    os.chmod(config.socket_path, 0o660)
    if config.peer.insecure and (config.node.listen or config.peer.addresses):
        log.warning(
            "[peer] insecure = true: peers speak plaintext, unauthenticated; anyone who reaches %s can act as a peer",
            config.node.listen or "this node's peer port",
        )
    for warning in exposure_warnings(config):
        log.warning("%s", warning)
    if config.commit_keys.signing:
        ids = config.commit_keys.key_ids
        log.info("commit records signed with key %s, checked with keys %s ([security])", ids[0], ", ".join(ids))
    data_listener: DataListener | None = None
    peer_server: grpc.aio.Server | None = None
    try:
        data_listener = await _listen_for_data(config, node) if config.node.listen else None
        node.serving(data_listener.port if data_listener is not None else 0, guard.counters)
        peer_server = await _serve_peers(config, node, guard, data_listener) if config.node.listen else None
        metrics_server = await _serve_metrics(config, node.report) if config.metrics.listen else None
    except ListenFailed:
        # Stopped here, on the running loop: a grpc.aio server left to its finaliser schedules its
        # shutdown on a loop already closed, and Python prints that traceback after the exit message.
        await server.stop(None)
        if data_listener is not None:
            await data_listener.stop()
        if peer_server is not None:
            await peer_server.stop(None)
        config.socket_path.unlink(missing_ok=True)
        raise

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = loop.create_task(_watchdog(stop))
    log.info("ckptd serving on %s, root %s, staging %s", config.socket_path, config.root, config.staging_dir)
    sd_notify.notify(f"READY=1\nSTATUS=serving on {config.socket_path}\nMAINPID={os.getpid()}")
    stopping, root_gone = loop.create_task(stop.wait()), loop.create_task(node.watch_root())
    await asyncio.wait({stopping, root_gone}, return_when=asyncio.FIRST_COMPLETED)
    gone = root_gone.done()
    stopping.cancel()
    root_gone.cancel()
    if gone:
        freed = await node.give_back_staging()
        log.error(
            "the NVMe root %s is gone (removed, or replaced by another): removed the staging directory %s "
            "(%d bytes of slots) and stopping",
            config.root, config.staging_dir, freed,
        )  # fmt: skip

    log.info("stopping: draining in-flight work")
    sd_notify.notify("STOPPING=1")
    watchdog.cancel()
    await server.stop(STOP_GRACE_S)
    if data_listener is not None:
        await data_listener.stop()
    if peer_server is not None:
        await peer_server.stop(STOP_GRACE_S)
    if metrics_server is not None:
        metrics_server.close()
    await node.drain()
    config.socket_path.unlink(missing_ok=True)
    log.info("stopped")
    if gone:
        raise RootGone(f"the NVMe root {config.root} was removed or replaced under the daemon")


async def _listen_for_data(config: Config, node: Node) -> DataListener | None:
    """Take replicas' bytes on a data connection beside gRPC, unless [peer] data_channel = false."""
    if not config.peer.data_channel:
        return None
    host = host_of(config.node.listen)
    listener = DataListener(
        node.receiver, config.peer, host, lambda: node.verification_failed("peer"), node.executors.data_connections
    )
    try:
        await listener.start()
    except OSError as e:
        raise ListenFailed(
            f"cannot take peers' data on {host} port {config.peer.data_port} (peer.data_port): {e}"
        ) from None
    log.info("taking replicas' bytes on %s port %d (peer data channel)", host, listener.port)
    return listener


async def _serve_peers(
    config: Config, node: Node, guard: RequestGuard, data_listener: DataListener | None
) -> grpc.aio.Server:
    server = grpc.aio.server(options=server_options(), maximum_concurrent_rpcs=MAX_PEER_RPCS)
    threads = node.executors
    peer_servicer = PeerServicer(
        node.save_path, node.locator, node.peering, node.receiver, node.verification_failed, node.instance,
        config, threads.serve, threads.records, data_listener, guard,
    )  # fmt: skip
    add_peer_servicer(peer_servicer, server, guard)
    view = node.view
    if isinstance(view, PeersView):  # the built-in cluster view's calls, on the same port
        add_cluster_servicer(view, server, guard, peer_servicer.admit, threads.records)
    credentials = server_credentials(config.peer)
    try:
        if credentials is None:
            server.add_insecure_port(config.node.listen)
        else:
            server.add_secure_port(config.node.listen, credentials)
    except RuntimeError as e:  # grpc says only "Failed to bind"
        await server.stop(None)  # never started, but stopped on this loop (see _serve_holding_root)
        raise ListenFailed(f"cannot listen for peers on {config.node.listen} (node.listen): {e}") from None
    await server.start()
    log.info(
        "serving peers on %s (%s)", config.node.listen, "TLS with client certificates" if credentials else "plaintext"
    )
    return server


async def _serve_metrics(config: Config, report: StatusReport) -> asyncio.Server:
    try:
        server = await metrics.serve(config.metrics.listen, report.metrics_page)
    except OSError as e:
        raise ListenFailed(f"cannot serve metrics on {config.metrics.listen} (metrics.listen): {e}") from None
    log.info("serving Prometheus metrics on http://%s/metrics", config.metrics.listen)
    return server


def exposure_warnings(config: Config) -> list[str]:
    """Return what the config exposes beyond this machine without authentication (said at start, like insecure)."""
    warnings = []
    if config.metrics.listen and not _loopback(host_of(config.metrics.listen)):
        warnings.append(
            f"[metrics] listen = {config.metrics.listen}: plain HTTP without authentication beyond this machine; "
            "anyone who reaches it reads job names and counters (bind to 127.0.0.1 or a private address)"
        )
    if config.cluster.backend == "etcd" and not config.cluster.ca:
        warnings.append(
            "[cluster] etcd without TLS (no cluster.cert, key, ca): anyone who reaches etcd, or the network between, "
            "can read and write the cluster view"
        )
    if not config.commit_keys.signing and (config.peer.addresses or config.object.url):
        warnings.append(
            "[security] no key_file: commit records are neither signed nor checked; whoever can write a peer's "
            "replicas or the object store can plant a step that loads as complete (see OPERATIONS, Security)"
        )
    return warnings


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _paced_accept_failures(pace: LogPace) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """Return an event loop exception handler that says a failed accept (EMFILE...) once a minute.

    asyncio retries a listening socket (metrics) a second after accept fails for want of descriptors,
    and logs every failure; anything else goes to asyncio's own handler as before.
    """

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if context.get("message") == ACCEPT_OUT_OF_RESOURCES and isinstance(error, OSError):
            if pace.due(error.errno):
                log.error("cannot accept connections: %s (said once a minute while it lasts)", error)
            return
        loop.default_exception_handler(context)

    return handle


async def _watchdog(stop: asyncio.Event) -> None:
    # Sent from the event loop itself, so a stuck loop stops the pings and systemd restarts us.
    interval_s = sd_notify.watchdog_interval_s()
    if interval_s is None:
        return
    while not stop.is_set():
        sd_notify.notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)


def _pin(cpus: set[int]) -> None:
    """Run every thread of the daemon on cpus ([node] cpus), those started already by imports too."""
    try:
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cpus)
    except OSError as e:  # EINVAL: none of them is in this process's cpuset (a container's, a cgroup's)
        raise ConfigError(f"node.cpus: cannot run on CPUs {sorted(cpus)} here: {e}") from None
    log.info("running on CPUs %s ([node] cpus)", ",".join(map(str, sorted(cpus))))


def _claim_socket(path: Path) -> None:
    # Made by another user first (/tmp/ckptd-UID is known in advance), it would let them take the socket.
    claim_dir(path.parent, DIR_MODE, "the socket directory", "node.socket", group_may_write=True)
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left by a daemon that died
            return
    raise AlreadyServing(f"another ckptd is already serving on {path}")
