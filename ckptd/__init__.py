"""ckptd: the per-node checkpoint daemon and its command-line tools."""

from ckpt_core._version import __version__

__all__ = ["__version__"]
