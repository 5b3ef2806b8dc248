"""The object tier: complete steps in an object store, one module per role (the tier, keys, layout, shards)."""
