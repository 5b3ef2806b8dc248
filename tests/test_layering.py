"""The layers point one way: ckpt and ckptd share ckpt_core and never import each other; only the servicer layer
sees protobuf; no torch in ckptd."""

from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The modules of ckptd that may touch protobuf messages: the RPC edges (our servers; the links out to other
# nodes, which live with the cluster as etcd's client and its stubs do) and the programs that call them.
WIRE_ALLOWED = {
    "ckptd/rpc",
    "ckptd/daemon.py",
    "ckptd/cli.py",
    "ckptd/cluster/peer_link.py",
    "ckptd/cluster/cluster_link.py",
    "ckptd/cluster/etcd_client.py",
    "ckptd/cluster/etcd_wire",
}
# The daemon's core (every package by role, in the order data flows) never imports the programs or offline tools.
CORE = ("rpc", "save", "replication", "load", "tiers", "storage", "cluster", "operations")
CORE_NEVER_IMPORTS = ("ckptd.offline", "ckptd.cli", "ckptd.daemon")


def _imports(path: Path) -> set[str]:
    """Name every module path imports, and every name it takes from one: `from ckpt_core import wire` counts as
    both ckpt_core and ckpt_core.wire; a relative import is resolved against path's package."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = path.relative_to(REPO / "client" if path.is_relative_to(REPO / "client") else REPO).parts
                module = ".".join([*package[: len(package) - node.level], *([module] if module else [])])
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def _modules(package: Path) -> list[Path]:
    return [p for p in package.rglob("*.py") if "wire" not in p.parts]


def _names(names: set[str], package: str) -> set[str]:
    return {n for n in names if n == package or n.startswith(package + ".")}


@pytest.mark.parametrize("path", _modules(REPO / "client" / "ckpt"), ids=lambda p: p.name)
def test_client_never_imports_the_daemon(path):
    assert not _names(_imports(path), "ckptd"), path


@pytest.mark.parametrize("path", _modules(REPO / "client" / "ckpt_core"), ids=lambda p: p.name)
def test_the_shared_core_imports_neither_side(path):
    assert not _names(_imports(path), "ckpt") | _names(_imports(path), "ckptd"), path


# The daemon imports the shared core, never the client. The CLI's commands that are clients of a running daemon
# (its DaemonClient) and the two torch tools (export reads a step as a trainer loads it, ingest saves a torch file
# as a trainer saves it) use the client as a library; `ckptd serve` never loads it (the check below).
DAEMON_USES_THE_CLIENT = {"ckptd/cli.py", "ckptd/offline/export.py", "ckptd/offline/ingest.py"}


@pytest.mark.parametrize("path", _modules(REPO / "ckptd"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_daemon_imports_the_core_not_the_client(path):
    if str(path.relative_to(REPO)) in DAEMON_USES_THE_CLIENT:
        return
    assert not _names(_imports(path), "ckpt"), path


def _loaded_by(*modules: str) -> set[str]:
    """Return every module a fresh interpreter has loaded once it imported modules."""
    code = f"import json, sys, {', '.join(modules)}\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout))


def test_serving_never_loads_the_client():
    serving = _loaded_by(
        "ckptd.daemon", "ckptd.node", "ckptd.rpc.server", "ckptd.rpc.peer_server", "ckptd.offline.restore"
    )
    assert not _names(serving, "ckpt"), sorted(_names(serving, "ckpt"))


@pytest.mark.parametrize("path", _modules(REPO / "ckptd"), ids=lambda p: str(p.relative_to(REPO)))
def test_below_the_servicer_nothing_sees_protobuf(path):
    relative = str(path.relative_to(REPO))
    if any(relative == allowed or relative.startswith(allowed + "/") for allowed in WIRE_ALLOWED):
        return
    assert not any(n.startswith(("ckpt_core.wire", "grpc")) for n in _imports(path)), path


@pytest.mark.parametrize(
    "path", [p for part in CORE for p in _modules(REPO / "ckptd" / part)], ids=lambda p: str(p.relative_to(REPO))
)
def test_the_core_never_imports_the_programs_or_offline_tools(path):
    assert not any(n.startswith(CORE_NEVER_IMPORTS) for n in _imports(path)), path


def test_every_package_is_covered():
    packages = {p.parent.name for p in (REPO / "ckptd").rglob("__init__.py")} - {"ckptd", "etcd_wire", "object"}
    assert packages <= {*CORE, "offline"}, packages


def test_the_daemon_moves_bytes_without_torch():
    loaded = _loaded_by(
        "ckptd.cli", "ckptd.daemon", "ckptd.node", "ckptd.offline.restore", "ckptd.offline.verify", "ckptd.rpc.server"
    )
    assert "torch" not in loaded, "torch was imported"


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


def _constructions(path: Path, kinds: set[str]) -> list[str]:
    """Where path builds one of kinds (class names): called by name, through a module, under another name (`import
    ... as`), or subclassed. Annotations that only name a kind are no construction."""
    tree = ast.parse(path.read_text())
    aliases = {a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names if a.name in kinds}
    built = kinds | (aliases - {None})

    def names_a_kind(expression: ast.expr) -> bool:
        return (isinstance(expression, ast.Name) and expression.id in built) or (
            isinstance(expression, ast.Attribute) and expression.attr in kinds
        )

    found = [
        f"{n.lineno}: {ast.unparse(n)[:60]}" for n in ast.walk(tree) if isinstance(n, ast.Call) and names_a_kind(n.func)
    ]
    found += [
        f"{n.lineno}: class {n.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and any(map(names_a_kind, n.bases))
    ]
    return found


POOL_KINDS = {"ThreadPoolExecutor", "ProcessPoolExecutor", "ThreadPool", "Pool"}
THREAD_KINDS = {"Thread", "Timer", "Process", "start_new_thread"}


@pytest.mark.parametrize("path", _daemon_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_only_the_composition_root_builds_thread_pools(path):
    relative = str(path.relative_to(REPO))
    if relative == "ckptd/node.py" or relative in POOLS_ELSEWHERE:
        return
    built = _constructions(path, POOL_KINDS)
    assert not built, f"{relative} builds a pool: {built}: take one from node.Executors"


def test_a_pool_is_found_under_another_name_and_as_a_base_class(tmp_path):
    hidden = tmp_path / "hidden.py"
    hidden.write_text(
        "import concurrent.futures as cf\nfrom threading import Thread as T\n"
        "class Pump(T):\n    pass\n"
        "def make():\n    return cf.ThreadPoolExecutor(2)\n"
        "def typed(pool: cf.ThreadPoolExecutor) -> None:\n    pass\n"
    )
    assert [f.split(":")[0] for f in _constructions(hidden, POOL_KINDS)] == ["6"]
    assert [f.split(":")[0] for f in _constructions(hidden, THREAD_KINDS)] == ["3"]


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
def test_the_edges_call_the_roles_and_never_reach_past_them(path):
    # The RPC edges and the program get what they use at construction: `node.save_path.peering`
    # and the like (a role behind a role the root built) are not theirs to touch.
    past = [
        f"{n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and ast.unparse(n.value).split(".")[-2:-1] == ["node"]
        and ast.unparse(n.value) != "node.executors"  # the root's thread pools, handed to an edge it builds
    ]
    assert not past, past


def test_there_is_no_pipeline_between_the_edges_and_the_roles():
    # The servers call the roles the composition root hands them: no object in between passes their calls on.
    assert not (REPO / "ckptd" / "pipeline.py").exists()
    daemon = (REPO / "ckptd" / "daemon.py").read_text()
    assert "pipeline" not in daemon.lower() and "pipeline" not in (REPO / "ckptd" / "node.py").read_text().lower()


# What a servicer holds besides the roles that answer its RPCs: the guard logs refusals, and the replica's
# bytes go to the receiver and the data listener range by range (one receive loop, ReplicaReceiver's).
EDGE_HELPERS = {"guard", "_guard", "receiver", "data_listener"}


def _role_calls(statements: list[ast.stmt]) -> int:
    """Return the most calls into roles (`self.role.method(...)`) one pass through statements makes (an if's arms:
    the larger one)."""

    def calls_in(node: ast.AST) -> int:
        return sum(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and len(chain := ast.unparse(n.func.value).split(".")) == 2
            and chain[0] == "self"
            and chain[1] not in EDGE_HELPERS
            for n in ast.walk(node)
        )

    total = 0
    for s in statements:
        if isinstance(s, ast.If):
            total += calls_in(s.test) + max(_role_calls(s.body), _role_calls(s.orelse))
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            total += _role_calls(s.body)
        else:
            total += calls_in(s)
    return total


@pytest.mark.parametrize("path", _modules(REPO / "ckptd" / "rpc"), ids=lambda p: str(p.relative_to(REPO)))
def test_each_rpc_is_one_call_into_a_role(path):
    # A sequence of calls (Reserve's retention, line, slot and spare) is the order of a role, not the servicer's:
    # the servicer translates a message into one call and its answer back.
    handlers = [
        f
        for f in ast.walk(ast.parse(path.read_text()))
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name[:1].isupper()
    ]
    more = {f.name: n for f in handlers if (n := _role_calls(f.body)) > 1}
    assert not more, f"RPC handlers that make several calls into roles: {more}"


def test_a_handler_that_calls_two_roles_is_counted():
    handler = ast.parse(
        "async def Reserve(self, request, context):\n"
        "    self.guard.note(context)\n"  # a helper of the edge: not counted
        "    line = await self.save_path.line_for(request)\n"
        "    if request.prepare:\n        return await self.save_path.prepare(line)\n"
        "    else:\n        await self.retention.retain('sealed')\n"
        "    return self._reply(line)\n"  # the servicer's own translation: not counted
    ).body[0]
    assert isinstance(handler, ast.AsyncFunctionDef)
    assert _role_calls(handler.body) == 2


# On the client, one module speaks to the daemon: ckpt.transport's DaemonClient takes and returns plain
# values; the save path, the load path and the adapters never build a protobuf message or call an RPC by name.
CLIENT_WIRE_ALLOWED = {"transport.py"}


@pytest.mark.parametrize("path", _modules(REPO / "client" / "ckpt"), ids=lambda p: p.name)
def test_on_the_client_only_the_daemon_client_speaks_protobuf(path):
    if str(path.relative_to(REPO / "client" / "ckpt")) in CLIENT_WIRE_ALLOWED:
        return
    assert not any(n.startswith(("ckpt_core.wire", "grpc")) for n in _imports(path)), path


# Private attributes read on another object than self, each with its reason: what a client role needs
# of another it gets at construction or through a method (no `handle._c._daemon`, `c._save_async`).
CLIENT_PRIVATE_READS = {
    "ckpt_core/format.py": "a ShardMeta classmethod seals the record it has just built",
    "ckpt/huggingface.py": "the Accelerator's _models, _optimizers, _schedulers and _custom_objects: what its own "
    "save_state saves, which it offers no public name for",
    "ckpt/lightning.py": "torch's Tensor._version, the in-place counter it has no public name for",
    "ckpt/torchtitan.py": "torchtitan's CheckpointManager hooks (_load, _close): BaseCheckpointManager names them for "
    "subclasses to override, and the override calls torchtitan's own through super()",
    "ckpt/skeleton_unpickler.py": "torch.load(weights_only=True)'s allow-list, which torch offers no public name for",
}


@pytest.mark.parametrize(
    "path", _modules(REPO / "client" / "ckpt") + _modules(REPO / "client" / "ckpt_core"), ids=lambda p: p.name
)
def test_no_client_module_reads_another_objects_private_attributes(path):
    if str(path.relative_to(REPO / "client")) in CLIENT_PRIVATE_READS:
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
    started = _constructions(path, THREAD_KINDS)
    assert not started, f"{relative} starts a thread: {started}: take a pool from node.Executors"


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


# -- The package order ------------------------------------------------------------------------------------------
# Each package of ckptd is one node, each top-level module (config, errors, metrics, node, pipeline, daemon...) its
# own; an import of any kind (at the top, in a function, for types only) is an edge. Reading from the bottom: the
# shared leaves (errors, config, byte_range, shard_key, log_pace, metrics), storage, cluster (membership, placement
# and the links out to other nodes), tiers, replication, save, operations, load, the RPC edge (servers), the
# composition root (node, pipeline), the programs (daemon, cli) and the offline tools.


def _node_of(module: str) -> str | None:
    """Return the node of the package graph a ckptd module belongs to (None: not ckptd's)."""
    parts = module.split(".")
    if parts[0] != "ckptd":
        return None
    if len(parts) == 1:
        return "ckptd"
    if (REPO / "ckptd" / parts[1]).is_dir():
        return parts[1]
    return f"ckptd.{parts[1]}"


def _package_graph() -> dict[tuple[str, str], str]:
    """Return each edge between the nodes of ckptd's package graph, with one import that makes it."""
    edges: dict[tuple[str, str], str] = {}
    for path in _modules(REPO / "ckptd"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        source = _node_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from ckptd import metrics` imports the module ckptd.metrics, not the package
                targets = [f"{node.module}.{a.name}" if node.module == "ckptd" else node.module for a in node.names]
            else:
                continue
            for target in targets:
                end = _node_of(target)
                if end is not None and source is not None and end != source:
                    edges.setdefault((source, end), f"{module} imports {target}")
    return edges


def _a_cycle(edges: dict[tuple[str, str], str]) -> list[str]:
    """Return one cycle of the graph as its nodes, first repeated at the end; [] if there is none."""
    following: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        following.setdefault(a, []).append(b)
    state: dict[str, str] = {}  # node -> "open" while on the path, "done" once every path from it is known

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in following.get(node, []):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = "done"
        return []

    for start in sorted(following):
        if start not in state and (found := visit(start, [])):
            return found
    return []


def test_the_packages_import_each_other_in_one_order():
    edges = _package_graph()
    cycle = _a_cycle(edges)
    steps = [f"{a} -> {b} ({edges[(a, b)]})" for a, b in itertools.pairwise(cycle)]
    assert not cycle, "a loop between ckptd's packages:\n  " + "\n  ".join(steps)


def test_a_loop_is_found_and_named():
    edges = {("save", "tiers"): "x", ("tiers", "cluster"): "y", ("cluster", "save"): "z", ("rpc", "save"): "w"}
    assert _a_cycle(edges) == ["cluster", "save", "tiers", "cluster"]
    assert _a_cycle({("rpc", "save"): "w", ("save", "tiers"): "x"}) == []


# -- No reach-ins -----------------------------------------------------------------------------------------------
# A role may call a role it holds, or read one attribute of it; reading through that attribute again
# (`self.progress.passed_over.passed_over(...)`, `uploader.config.object.every`) is a reach-in: it ties the
# reader to how the other role is built. The owner offers a method, or the reader gets the thing at construction.
#
# Precisely: a *role* is a class of ckptd that is not a dataclass (a record or a frozen config), an exception, an
# enum or a named tuple. A *role attribute* is a name under which some class keeps a role (`self.x = x` with x
# annotated as a role, or `self.x = Role(...)`). A reach-in is a chain of attributes read
#   self.R.a.b...   R a role attribute: two dots into a role held;
#   r.a.b...        r a parameter annotated as a role, or a local that is `self.R`: the same, held for a moment.
# Not reach-ins: module paths (`os.path.join`, the root is an import), chains through records and config
# (`self.config.staging.policy`, `slot.shard.step`: dataclasses, frozen values, nothing that acts), enum members,
# and `self.x.method()` (one dot past a collaborator).

# The one chain allowed, as test_the_edges_call_the_pipeline_and_never_reach_past_it allows it: the program
# hands the root's thread pools (a frozen record of them) to the edges it builds.
REACH_INS_ALLOWED = ("node.executors.",)
_NOT_ROLES = ("Exception", "Error", "Enum", "IntEnum", "NamedTuple", "TypedDict", "Warning")


def _classes(trees: list[ast.Module]) -> dict[str, ast.ClassDef]:
    return {n.name: n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}


def _is_role(name: str, classes: dict[str, ast.ClassDef], seen: frozenset[str] = frozenset()) -> bool:
    c = classes.get(name)
    if c is None or any("dataclass" in ast.unparse(d) for d in c.decorator_list):
        return False
    for base in (ast.unparse(b).split("[")[0].split(".")[-1] for b in c.bases):
        if base.endswith(_NOT_ROLES) or base == "CheckpointError" or base == "OSError":
            return False
        if base in classes and base not in seen and not _is_role(base, classes, seen | {name}):
            return False
    return True


def _names_in(annotation: ast.expr) -> set[str]:
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}
    return names | {
        word
        for n in ast.walk(annotation)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
        for word in n.value.replace("|", " ").replace("[", " ").replace("]", " ").split()
    }


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _role_parameters(f: ast.FunctionDef | ast.AsyncFunctionDef, roles: set[str]) -> set[str]:
    arguments = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]
    return {a.arg for a in arguments if a.annotation is not None and _names_in(a.annotation) & roles}


def _role_attributes(trees: list[ast.Module], roles: set[str]) -> set[str]:
    """Return the names under which some class of ckptd keeps a role."""
    found: set[str] = set()
    for f in (f for t in trees for f in _functions(t)):
        annotated = {a.arg: a.annotation for a in [*f.args.args, *f.args.kwonlyargs] if a.annotation is not None}
        for n in ast.walk(f):
            if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None:
                continue
            kinds = _names_in(n.annotation) if isinstance(n, ast.AnnAssign) else set()
            if isinstance(n.value, ast.Name) and n.value.id in annotated:
                kinds |= _names_in(annotated[n.value.id])
            if isinstance(n.value, ast.Call):
                kinds.add(ast.unparse(n.value.func).split(".")[-1])
            for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self" and kinds & roles:
                    found.add(target.attr)
    return found


def _chain(node: ast.expr) -> list[str]:
    """Return `a.b.c` as ["a", "b", "c"]; [] when the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _reach_ins(tree: ast.Module, roles: set[str], role_attributes: set[str]) -> list[str]:
    found = []
    for f in _functions(tree):
        held = _role_parameters(f, roles) | {
            t.id
            for n in ast.walk(f)
            if isinstance(n, ast.Assign)
            and (c := _chain(n.value))[:1] == ["self"]
            and c[1:]
            and c[-1] in role_attributes
            and len(c) == 2
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        inner = {id(n.value) for n in ast.walk(f) if isinstance(n, ast.Attribute)}
        for n in ast.walk(f):
            if not isinstance(n, ast.Attribute) or id(n) in inner:
                continue
            chain = _chain(n)
            through_self = chain[:1] == ["self"] and len(chain) >= 4 and chain[1] in role_attributes
            through_held = bool(chain) and chain[0] in held and len(chain) >= 3
            if (through_self or through_held) and not ".".join(chain).startswith(REACH_INS_ALLOWED):
                found.append(f"{n.lineno}: {'.'.join(chain)}")
    return sorted(set(found))


def _all_reach_ins(root: Path) -> dict[str, list[str]]:
    paths = _modules(root / "ckptd")
    trees = [ast.parse(p.read_text()) for p in paths]
    classes = _classes(trees)
    roles = {name for name in classes if _is_role(name, classes)}
    role_attributes = _role_attributes(trees, roles)
    found = {str(p.relative_to(root)): _reach_ins(t, roles, role_attributes) for p, t in zip(paths, trees, strict=True)}
    return {path: lines for path, lines in found.items() if lines}


def test_no_role_reads_through_another_role():
    found = _all_reach_ins(REPO)
    assert not found, "reach-ins (the owner offers a method, or the reader gets the thing at construction):\n" + (
        "\n".join(f"  {path} {line}" for path, lines in sorted(found.items()) for line in lines)
    )


def test_a_reach_in_is_told_from_a_record_and_a_config(tmp_path):
    (tmp_path / "ckptd").mkdir()
    (tmp_path / "ckptd" / "roles.py").write_text(
        "import os\n"
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class Config:\n    every: int\n"
        "class Passed:\n    def passed(self): ...\n"
        "class Progress:\n"
        "    def __init__(self, config: Config):\n        self.config = config\n        self.passed = Passed()\n"
        "class Saver:\n"
        "    def __init__(self, progress: Progress, config: Config):\n"
        "        self.progress = progress\n        self.config = config\n"
        "    def save(self, slot, other: Progress):\n"
        "        self.progress.passed.passed()\n"  # reach-in
        "        mine = self.progress\n        mine.passed.passed()\n"  # reach-in, through a local
        "        other.config.every\n"  # reach-in: another role's config
        "        self.config.every, slot.shard.step, os.path.join('a'), self.progress.changed()\n"  # not
    )
    assert _all_reach_ins(tmp_path) == {
        "ckptd/roles.py": ["17: self.progress.passed.passed", "19: mine.passed.passed", "20: other.config.every"]
    }


# -- One writer of the catalog -------------------------------------------------------------------------------------
# A tier's catalog says which steps are complete there: a commit record puts a step in, a removal takes it out.
# Outside the tiers (and the commit protocol they use), only the save path changes it: SavePath seals and adopts (a
# flush, a replica's arrival and its sender's record, a commit the cluster learned, a round of catching up,
# retention's look for missed commits) and releases (what retention, `ckptd rm` and `gc --all` decided goes), the
# Uploader commits a step in the object store; and the load path's fetched copies (load/fetch.py) and the offline
# restore's target seal what they copied (and remove what they left half done). Reconciliation, retention,
# membership and the receiver ask the save path.
CATALOG_WRITES = {"adopt_commit", "try_commit", "write_commit", "remove_step"}
CATALOG_WRITERS = {
    "ckptd/save/save_path.py",
    "ckptd/save/uploading.py",
    "ckptd/load/fetch.py",
    "ckptd/offline/restore.py",
}
CATALOG_OWNERS = ("ckptd/tiers/", "ckptd/storage/")
# Asking the save path (its own method, or a role holding it) is not a write to a tier.
ASKS_THE_SAVE_PATH = {"self", "_save_path", "save_path"}


def _catalog_writes(root: Path) -> list[str]:
    """Return each use of a tier's catalog-changing method outside its allowed writers, as `path line: a.b.method`."""
    found = []
    for path in _modules(root / "ckptd"):
        where = str(path.relative_to(root))
        if where in CATALOG_WRITERS or where.startswith(CATALOG_OWNERS):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in CATALOG_WRITES:
                receiver = ast.unparse(n.value).split(".")[-1]
                if receiver not in ASKS_THE_SAVE_PATH:
                    found.append(f"{where} {n.lineno}: {ast.unparse(n)}")
    return sorted(found)


def test_only_the_save_path_and_the_load_paths_copies_write_a_tiers_catalog():
    found = _catalog_writes(REPO)
    assert not found, "a tier's catalog changed outside the save path (ask SavePath to seal, adopt or release):\n" + (
        "\n".join(f"  {line}" for line in found)
    )


# -- Tiers cut by capability ---------------------------------------------------------------------------------------
# A tier offers at most three small interfaces (ckptd/tiers/base.py): a ShardReader, a StepListing (a StepCatalog where
# the tier is written, a ShardCatalog where it is written shard by shard on this node's disk), a ShardSink. Roles hold a
# tier by these; only the composition root and the offline tools' builder name the classes.
TIER_CLASSES = {
    "LocalDirTier": "ckptd/tiers/nvme.py",
    "ObjectTier": "ckptd/tiers/object/tier.py",
    "PeerTier": "ckptd/tiers/peer.py",
    "MemoryTier": "ckptd/tiers/memory.py",
}
TIER_INTERFACES = ("ShardReader", "StepListing", "StepCatalog", "ShardCatalog", "ShardSink")
NAME_THE_TIER_CLASSES = {"ckptd/node.py", "ckptd/offline/restore.py"}


def _public_methods(tree: ast.Module, class_name: str) -> set[str]:
    names = set()
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name):
        names |= {f.name for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        names |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def _off_interface_methods(root: Path) -> tuple[set[str], set[str]]:
    """Return the public names the tier classes have and no interface offers: those no other class of ckptd has,
    and those other classes keep as attributes only (their reads are not a tier's; their calls are)."""
    base = ast.parse((root / "ckptd/tiers/base.py").read_text())
    offered = {name for i in TIER_INTERFACES for name in _public_methods(base, i)}
    concrete = set()
    for class_name, module in TIER_CLASSES.items():
        concrete |= _public_methods(ast.parse((root / module).read_text()), class_name)
    methods, attributes = set(), set()  # of classes outside the tiers: a shared name is told apart by mypy
    for path in _modules(root / "ckptd"):
        if not str(path.relative_to(root)).startswith("ckptd/tiers/"):
            tree = ast.parse(path.read_text())
            for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
                methods |= {f.name for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                attributes |= _public_methods(tree, c.name)
            attributes |= {
                t.attr
                for n in ast.walk(tree)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
            }
    off = concrete - offered - methods - {"from_directory"}  # MemoryTier.from_directory builds one: a builder's
    return off - attributes, off & attributes


def _tier_class_uses(root: Path) -> dict[str, list[str]]:
    """Return, by module outside ckptd/tiers, where it names a tier class or uses a tier method no interface has."""
    only_tiers, also_attributes = _off_interface_methods(root)
    found: dict[str, list[str]] = {}
    for path in _modules(root / "ckptd"):
        where = str(path.relative_to(root))
        if where.startswith("ckptd/tiers/"):
            continue
        uses = []
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and where not in NAME_THE_TIER_CLASSES:
                uses += [f"{n.lineno}: imports {a.name}" for a in n.names if a.name in TIER_CLASSES]
            if isinstance(n, ast.Attribute) and n.attr in only_tiers:  # called, or handed to a thread
                uses.append(f"{n.lineno}: uses {ast.unparse(n)}")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in also_attributes:
                uses.append(f"{n.lineno}: calls {ast.unparse(n.func)}")
        if uses:
            found[where] = uses
    return found


def test_roles_hold_a_tier_by_its_interfaces(tmp_path):
    found = _tier_class_uses(REPO)
    assert not found, "a role names a tier class or calls past the tier interfaces (tiers/base.py):\n" + (
        "\n".join(f"  {path} {use}" for path, uses in sorted(found.items()) for use in uses)
    )
    # The check finds what it is there for, in a copy of the tiers: a role that imports a tier class, or calls a
    # method a tier class has and no interface offers (as roles once called LocalDirTier.step_dir).
    for module in {"ckptd/tiers/base.py", *TIER_CLASSES.values()}:
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text((REPO / module).read_text())
    nvme = tmp_path / TIER_CLASSES["LocalDirTier"]
    nvme.write_text(nvme.read_text() + "\n\nclass LocalDirTier:\n    def step_dir(self, job, step): ...\n")
    (tmp_path / "ckptd/save").mkdir()
    (tmp_path / "ckptd/save/role.py").write_text(
        "from ckptd.tiers.object.tier import ObjectTier\n"
        "def run(tier):\n"
        "    tier.holdings('j', 1)\n"  # an interface's: not reported
        "    return tier.step_dir('j', 1)\n"
    )
    assert _tier_class_uses(tmp_path) == {"ckptd/save/role.py": ["1: imports ObjectTier", "4: uses tier.step_dir"]}
