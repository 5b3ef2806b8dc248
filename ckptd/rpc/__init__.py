"""The RPC edges: the local servicer, the peer and cluster servicers, and the data listener; servers only (the
links out live in cluster/)."""
