"""Replication: send each shard to the peers that keep its replicas, receive theirs, seal steps across nodes."""
