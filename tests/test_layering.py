"""The layers point one way: ckpt never imports ckptd; only the servicer layer sees protobuf; no torch in ckptd."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The modules of ckptd that may touch protobuf messages: the servicer and the programs that call it.
WIRE_ALLOWED = {"server.py", "daemon.py", "cli.py", "peer_server.py", "peer_link.py"}  # the edges that translate


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(package: Path) -> list[Path]:
    return [p for p in package.rglob("*.py") if "wire" not in p.parts]


@pytest.mark.parametrize("path", _modules(REPO / "client" / "ckpt"), ids=lambda p: p.name)
def test_client_never_imports_the_daemon(path):
    assert not any(n == "ckptd" or n.startswith("ckptd.") for n in _imports(path))


@pytest.mark.parametrize("path", _modules(REPO / "ckptd"), ids=lambda p: str(p.relative_to(REPO)))
def test_below_the_servicer_nothing_sees_protobuf(path):
    if path.name in WIRE_ALLOWED and path.parent.name == "ckptd":
        return
    assert not any(n.startswith("ckpt.wire") or n.startswith("grpc") for n in _imports(path)), path


def test_the_daemon_moves_bytes_without_torch():
    code = (
        "import sys, ckptd.cli, ckptd.daemon, ckptd.pipeline, ckptd.restore, ckptd.server\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
