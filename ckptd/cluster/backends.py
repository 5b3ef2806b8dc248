"""Build the cluster view that [cluster] backend names; Node calls open_view() once, at construction."""

from __future__ import annotations

from concurrent.futures import Executor

from ckptd.cluster.cluster_link import ClusterLinks
from ckptd.cluster.etcd_view import EtcdView
from ckptd.cluster.peer_membership import ResolvedPeers
from ckptd.cluster.peers_view import PeersView
from ckptd.cluster.view import ClusterView
from ckptd.config import Config


def open_view(config: Config, resolve_threads: Executor, record_threads: Executor) -> ClusterView | None:
    """Return the configured cluster view, or None for a node with no peers (it seals every step alone).

    resolve_threads: the built-in view's DNS lookups (Executors.resolve); record_threads: its
    commit records serialized (Executors.records).
    """
    kept = max(config.retention.nvme, config.retention.peer)
    if config.cluster.backend == "etcd":
        return EtcdView(config, kept)
    if not config.peer.addresses:
        return None
    membership = ResolvedPeers(config, resolve_threads)
    links = ClusterLinks(config.peer, tls_name=membership.tls_name, commit_keys=config.commit_keys)
    node = config.node.listen or config.node.name
    anti_entropy_s, serves = config.cluster.anti_entropy_s, bool(config.node.listen)
    return PeersView(node, membership, links, kept, anti_entropy_s, record_threads, serves=serves)
