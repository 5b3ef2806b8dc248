"""The object tier: complete steps in an object store, a module per role (tier, shard_write, keys, layout, shards)."""
