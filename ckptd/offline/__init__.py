"""The tools that read tiers with no daemon: restore, verify and export (the CLI calls them; the core never does)."""
