"""The cluster view: who holds which shard of which step, which steps are committed, who is alive."""
