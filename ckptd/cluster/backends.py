"""Build the cluster view that [cluster] backend names; Node calls open_view() once, at construction."""

from __future__ import annotations

from ckptd.cluster.cluster_link import ClusterLinks
from ckptd.cluster.etcd_view import EtcdView
from ckptd.cluster.peer_membership import ResolvedPeers
from ckptd.cluster.peers_view import PeersView
from ckptd.cluster.view import ClusterView
from ckptd.config import Config


def open_view(config: Config) -> ClusterView | None:
    """Return the configured cluster view, or None for a node with no peers (it seals every step alone)."""
    kept = max(config.retention.nvme, config.retention.peer)
    if config.cluster.backend == "etcd":
        return EtcdView(config, kept)
    if not config.peer.addresses:
        return None
    membership = ResolvedPeers(config)
    links = ClusterLinks(config.peer, tls_name=membership.tls_name, commit_keys=config.commit_keys)
    node = config.node.listen or config.node.name
    return PeersView(node, membership, links, kept, config.cluster.anti_entropy_s, serves=bool(config.node.listen))
