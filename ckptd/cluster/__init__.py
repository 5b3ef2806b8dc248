"""The other nodes: who holds which shard of which step, which steps are committed, who is alive, and the links out
to them (peer_link, cluster_link, data_channel, with the shard stream and the TLS refusals they share with the
servers)."""
