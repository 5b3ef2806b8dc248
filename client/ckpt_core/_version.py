"""The release of ckpt and ckptd: the one place it is written (both distributions read it)."""

__version__ = "0.2.0"
