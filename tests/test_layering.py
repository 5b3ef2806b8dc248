"""The layers point one way: ckpt never imports ckptd; only the servicer layer sees protobuf; no torch in ckptd."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
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


# Thread pools built outside the composition root, each with its reason: none. Every pool of the
# daemon is in node.Executors, the tiers' fan-outs within one call too (ckptd.pool_map), and the
# offline tools build the same record (offline.restore.tool_threads).
POOLS_ELSEWHERE: dict[str, str] = {}
# Threads started outside the composition root, each with its reason.
THREADS_ELSEWHERE = {
    "ckptd/rpc/grpc_log.py": "reads what gRPC's C core writes to stderr, from before the pools exist to after them",
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


@pytest.mark.parametrize("path", _daemon_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_work_goes_to_the_default_executor(path):
    # asyncio.to_thread and run_in_executor(None, ...) run on Python's default pool: unnamed, sized by
    # the CPUs, shared by whatever asks. Each piece of work goes to the Executors pool of its role.
    found = [
        f"{n.lineno}: {ast.unparse(n)[:80]}"
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call)
        and (
            ast.unparse(n.func).endswith("to_thread")
            or (
                ast.unparse(n.func).endswith("run_in_executor")
                and n.args
                and isinstance(n.args[0], ast.Constant)
                and n.args[0].value is None
            )
        )
    ]
    assert not found, f"{path.relative_to(REPO)} runs work on the default executor: {found}"


@pytest.mark.parametrize("path", _daemon_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_only_the_composition_root_starts_threads(path):
    relative = str(path.relative_to(REPO))
    if relative in THREADS_ELSEWHERE:
        return
    started = [
        n.lineno
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and ast.unparse(n.func) in ("threading.Thread", "Thread", "threading.Timer", "Timer")
    ]
    assert not started, f"{relative} starts a thread at lines {started}: take a pool from node.Executors"


def test_the_thread_map_in_internals_is_the_executors_record():
    from ckptd.node import Executors

    executors = Executors.build()
    try:
        in_code = {f.name: getattr(executors, f.name)._max_workers for f in fields(executors)}
    finally:
        executors.shutdown()
    section = (REPO / "docs" / "INTERNALS.md").read_text().split("### The thread map", 1)[1].split("\n#", 1)[0]
    in_docs = {name: int(size) for name, size in re.findall(r"^\| `(\w+)` \| (\d+) \|", section, re.MULTILINE)}
    assert in_docs == in_code, "docs/INTERNALS.md's thread map and node.Executors differ (name: size)"
    assert f"{len(in_code)} pools" in section, f"the thread map does not say how many pools there are ({len(in_code)})"
