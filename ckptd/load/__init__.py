"""The load path: locate a shard on the tiers fastest first, fetch what this node lacks, serve sharded reads."""
