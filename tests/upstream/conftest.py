"""Run PyTorch's DCP tests and Lightning's checkpoint tests on ckptd storage (docs/GUIDE.md, "Upstream suites").

The test files are upstream's and are not in this repository: scripts/upstream_sources.sh copies them
in from checkouts of PyTorch and Lightning (git ignores them), and tests/upstream/README.md lists them,
their revisions and licences. What this directory adds is the adaptation, and only that: one ckptd
daemon for the session, and fixtures that hand upstream's code ckptd's storage where it would use its
own (dcp/conftest.py, lightning/conftest.py); upstream's assertions are untouched.
CKPTD_UPSTREAM_STORAGE=stock runs the same files on stock storage, to tell ckptd's failures from
mismatches between upstream's tests and the installed releases. Every test here is marked `upstream`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon

HERE = Path(__file__).parent
SITE = HERE / "site"
STORAGE = os.environ.get("CKPTD_UPSTREAM_STORAGE", "ckptd")
if STORAGE not in ("ckptd", "stock"):
    raise pytest.UsageError(f"CKPTD_UPSTREAM_STORAGE must be ckptd or stock, not {STORAGE!r}")
sys.path.insert(0, str(SITE))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.upstream)


@pytest.fixture(scope="session")
def upstream_daemon() -> Iterator[Daemon | None]:
    """Yield the daemon the upstream tests save into, one for the session (None on stock storage)."""
    if STORAGE == "stock":
        yield None
        return
    base = Path(tempfile.mkdtemp(prefix="ckt-up-"))
    daemon = Daemon(base)
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def upstream_env(upstream_daemon: Daemon | None, monkeypatch: pytest.MonkeyPatch) -> Daemon | None:
    """Point this test, and the processes it starts, at the session's daemon; return it (None on stock storage)."""
    if upstream_daemon is None:
        return None
    monkeypatch.setenv("CKPTD_ADDRESS", upstream_daemon.address)
    monkeypatch.setenv("CKPTD_UPSTREAM_STORAGE", "ckptd")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])))
    return upstream_daemon
