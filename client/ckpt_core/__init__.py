"""ckpt_core: what the training client (ckpt) and the daemon (ckptd) share, and neither owns.

The on-disk format and its records (format, step_index, shard_io), the chunk checks (chunks),
the history line (history), signed commits (commit_keys), the one set of errors (errors), the
byte ranges of every read and write (byte_range), a shard's name (shard_key), the daemon's
local socket (daemon_socket), the owner checks of paths (owned_paths) and the gRPC stubs (wire).
Both distributions carry this package; it imports nothing of ckpt or ckptd.
"""
