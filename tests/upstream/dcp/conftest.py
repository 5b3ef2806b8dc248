"""PyTorch's DCP tests on ckptd: FileSystemWriter/Reader(path) become ckpt.dcp.Writer/Reader on a job per path.

The swap (site/ckptd_upstream_storage.py) is installed when this file is imported, before the test
modules bind DCP's names, and is live only during these tests; the ranks a test spawns install it
themselves (site/sitecustomize.py, on the PYTHONPATH upstream_env gives them).
A file written for a newer torch than the installed one (it imports what this torch lacks) is
skipped with the import error, on either storage; FAILS_ON_STOCK marks tests that fail on stock
storage too, with the reason (tests/upstream/README.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ckptd_upstream_storage
import pytest

HERE = Path(__file__).parent
if os.environ.get("CKPTD_UPSTREAM_STORAGE", "ckptd") == "ckptd" and any(HERE.glob("test_*.py")):
    ckptd_upstream_storage.install()  # only where upstream's files were copied in: other runs keep DCP untouched


FAILS_ON_STOCK = {
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoad::test_dtype_mismatch_casting": (
        "fails on stock storage too: DefaultLoadPlanner(allow_unsafe_types=...) is newer than the installed torch"
    ),
}


class _Module(pytest.Module):
    """A test module that is skipped, not an error, when it imports what the installed torch lacks."""

    def _getobj(self) -> Any:
        try:
            return super()._getobj()
        except pytest.Collector.CollectError as e:
            if "ImportError" not in str(e) and "ModuleNotFoundError" not in str(e):
                raise
            pytest.skip(f"written for another torch: {str(e).strip().splitlines()[-1]}", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.parent == HERE:
        return _Module.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == HERE:
            reason = FAILS_ON_STOCK.get(f"{item.path.name}::{'::'.join(item.nodeid.split('::')[1:])}")
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))


@pytest.fixture(autouse=True)
def dcp_on_ckptd(upstream_env) -> Iterator[None]:
    """Make DCP's file-system storage ckptd's for this test (nothing on stock storage)."""
    ckptd_upstream_storage.active = upstream_env is not None
    try:
        yield
    finally:
        ckptd_upstream_storage.active = False
