"""PyTorch's DCP tests on ckptd: FileSystemWriter/Reader(path) become ckpt.dcp.Writer/Reader on a job per path.

The swap (site/ckptd_upstream_storage.py) is installed when this file is imported, before the test
modules bind DCP's names, and is live only during these tests; the ranks a test spawns install it
themselves (site/sitecustomize.py, on the PYTHONPATH upstream_env gives them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import ckptd_upstream_storage
import pytest

if os.environ.get("CKPTD_UPSTREAM_STORAGE", "ckptd") == "ckptd":
    ckptd_upstream_storage.install()


@pytest.fixture(autouse=True)
def dcp_on_ckptd(upstream_env) -> Iterator[None]:
    """Make DCP's file-system storage ckptd's for this test (nothing on stock storage)."""
    ckptd_upstream_storage.active = upstream_env is not None
    try:
        yield
    finally:
        ckptd_upstream_storage.active = False
