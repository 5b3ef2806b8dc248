"""ckptd: the per-node checkpoint daemon and its command-line tools."""

__version__ = "0.1.0"
