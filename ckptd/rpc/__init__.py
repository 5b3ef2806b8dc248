"""The RPC edges: the local servicer, the peer servicer and the peer client, and the wire form of shard bytes."""
