"""The layers point one way: ckpt never imports ckptd; only the servicer layer sees protobuf; no torch in ckptd."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The modules of ckptd that may touch protobuf messages: the RPC edges (ours, and etcd's client with its
# stubs) and the programs that call them.
WIRE_ALLOWED = {
    "ckptd/rpc",
    "ckptd/daemon.py",
    "ckptd/cli.py",
    "ckptd/cluster/etcd_client.py",
    "ckptd/cluster/etcd_wire",
}
# The daemon's core (every package by role, in the order data flows) never imports the programs or offline tools.
CORE = ("rpc", "save", "replication", "load", "tiers", "storage", "cluster", "operations")
CORE_NEVER_IMPORTS = ("ckptd.offline", "ckptd.cli", "ckptd.daemon")


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
    relative = str(path.relative_to(REPO))
    if any(relative == allowed or relative.startswith(allowed + "/") for allowed in WIRE_ALLOWED):
        return
    assert not any(n.startswith("ckpt.wire") or n.startswith("grpc") for n in _imports(path)), path


@pytest.mark.parametrize(
    "path", [p for part in CORE for p in _modules(REPO / "ckptd" / part)], ids=lambda p: str(p.relative_to(REPO))
)
def test_the_core_never_imports_the_programs_or_offline_tools(path):
    assert not any(n.startswith(CORE_NEVER_IMPORTS) for n in _imports(path)), path


def test_every_package_is_covered():
    packages = {p.parent.name for p in (REPO / "ckptd").rglob("__init__.py")} - {"ckptd", "etcd_wire", "object"}
    assert packages <= {*CORE, "offline"}, packages


def test_the_daemon_moves_bytes_without_torch():
    code = (
        "import sys, ckptd.cli, ckptd.daemon, ckptd.pipeline, ckptd.offline.restore, ckptd.offline.verify\n"
        "import ckptd.rpc.server, ckptd.rpc.peer_server\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# Thread pools built outside the composition root, each with its reason. Every long-lived pool of
# the daemon is in node.Executors; these are fan-outs inside one call (gone when it returns, and
# used by the offline tools too, which have no composition root), or owned by the cluster view.
POOLS_ELSEWHERE = {
    "ckptd/tiers/peer.py": "asks every peer's inventory at once, within one call",
    "ckptd/tiers/object/tier.py": "lists and reads a step's objects at once, within one call",
    "ckptd/tiers/object/shards.py": "checks a step's shards at once, within one call",
    "ckptd/cluster/peer_membership.py": "the built-in view's DNS lookups, one thread it owns",
    "ckptd/offline/restore.py": "the restore target's writers: `ckptd restore` is a program with no daemon",
}


def _daemon_modules() -> list[Path]:
    return [p for p in _modules(REPO / "ckptd")]


@pytest.mark.parametrize("path", _daemon_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_only_the_composition_root_builds_thread_pools(path):
    relative = str(path.relative_to(REPO))
    if relative == "ckptd/node.py" or relative in POOLS_ELSEWHERE:
        return
    calls = [
        n.lineno
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("ThreadPoolExecutor")
    ]
    assert not calls, f"{relative} builds a thread pool at lines {calls}: take one from node.Executors"


@pytest.mark.parametrize("path", _daemon_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_role_sets_what_another_role_owns(path):
    # `a.b.c = ...`: setting an attribute of an object held by another (a role wired after
    # construction, a counter kept behind its owner's back). The owner gets it at construction,
    # or offers a method.
    reached = []
    for n in ast.walk(ast.parse(path.read_text())):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        reached += [
            f"{n.lineno}: {ast.unparse(t)}"
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
        ]
    assert not reached, reached


@pytest.mark.parametrize(
    "path", [REPO / "ckptd" / "daemon.py", *_modules(REPO / "ckptd" / "rpc")], ids=lambda p: str(p.relative_to(REPO))
)
def test_the_edges_call_the_pipeline_and_never_reach_past_it(path):
    # The RPC edges and the program get what they use at construction: `pipeline.node.peering`
    # and the like (a role behind the pipeline or the root) are not theirs to touch.
    past = [
        f"{n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and ast.unparse(n.value).split(".")[-2:-1] in (["pipeline"], ["node"])
        and ast.unparse(n.value) != "node.executors"  # the root's thread pools, handed to an edge it builds
    ]
    assert not past, past


# On the client, one module speaks to the daemon: ckpt.transport's DaemonClient takes and returns plain
# values; the save path, the load path and the adapters never build a protobuf message or call an RPC by name.
CLIENT_WIRE_ALLOWED = {"transport.py"}


@pytest.mark.parametrize("path", _modules(REPO / "client" / "ckpt"), ids=lambda p: p.name)
def test_on_the_client_only_the_daemon_client_speaks_protobuf(path):
    if str(path.relative_to(REPO / "client" / "ckpt")) in CLIENT_WIRE_ALLOWED:
        return
    assert not any(n.startswith(("ckpt.wire", "grpc")) for n in _imports(path)), path


# Private attributes read on another object than self, each with its reason: what a client role needs
# of another it gets at construction or through a method (no `handle._c._daemon`, `c._save_async`).
CLIENT_PRIVATE_READS = {
    "format.py": "a ShardMeta classmethod seals the record it has just built",
    "lightning.py": "torch's Tensor._version, the in-place counter it has no public name for",
    "skeleton_unpickler.py": "torch.load(weights_only=True)'s allow-list, which torch offers no public name for",
}


@pytest.mark.parametrize("path", _modules(REPO / "client" / "ckpt"), ids=lambda p: p.name)
def test_no_client_module_reads_another_objects_private_attributes(path):
    if str(path.relative_to(REPO / "client" / "ckpt")) in CLIENT_PRIVATE_READS:
        return
    reached = [
        f"{n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and ast.unparse(n.value) not in ("self", "cls")
    ]
    assert not reached, reached
