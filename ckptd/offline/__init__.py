"""The tools that read tiers with no daemon: restore and verify (the CLI calls them; the daemon core never does)."""
