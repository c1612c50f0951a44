"""The layering of ../shared/DESIGN.md, enforced: no import circle, and dependencies that
point one way.

The graph is read from the source (``ast``), so a test run imports nothing it checks.
Every import counts, those inside functions included: a lazy import hides a circle, it
does not remove it. ``ddl/`` is ``ddl``, ``server/`` is ``ddl.server`` and
``clients/<name>/`` is ``ddl.<name>`` (as ``pyproject.toml`` maps them); the generated
stubs (``ddl/v1``) are leaves and are left out.

To change a rule here, change the layering in DESIGN.md first. (import-linter would
not do: its graph walks the ``ddl`` folder, so it never sees ``server/`` and
``clients/*``, which only the package-dir mapping puts into ``ddl``.)
"""

from __future__ import annotations

import ast
import os
from typing import Dict, Iterable, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the coordinator daemon may import from outside ``ddl.server`` besides the stubs
# (``ddl.v1``): the small core it shares with the workers, each for one reason.
SERVER_CORE = {
    "ddl._auth": "the job secret and the handshake both sides check",
    "ddl._config": "the configuration table (DDL_* variables)",
    "ddl._errors": "the typed errors",
    "ddl._limits": "message and frame size limits both sides enforce",
    "ddl._keepalive": "the gRPC keepalive settings both sides use",
    "ddl._report": "the fatal-error report files ddlrun reads",
    "ddl._pdeathsig": "dying with the launcher",
    "ddl._fusion": "the Tensor Fusion rule the leader and the cycles share",
    "ddl._cache_signature": "the response cache's key, computed by leader and workers alike",
    "ddl._dtypes": "dtype and op names and sizes on the wire",
    "ddl._reduction": "the dtype a reduction travels in (part of the cache's key)",
}

# The runtime and the public face: the data plane is below both and never reaches up.
RUNTIME = {"ddl._runtime", "ddl._engine", "ddl._control", "ddl._cycles", "ddl._execute",
           "ddl._cache", "ddl._results", "ddl._timeline", "ddl._start", "ddl._bootstrap",
           "ddl._node_rendezvous", "ddl._local_coordinator"}
PUBLIC_FACE = {"ddl", "ddl._api", "ddl._process_sets", "ddl._objects", "ddl._handle"}
DATA_PLANE = ("ddl.backends", "ddl.collectives", "ddl.transports")


def _roots() -> Dict[str, str]:
    roots = {"ddl": "ddl", "server": "ddl.server"}
    for name in sorted(os.listdir(os.path.join(ROOT, "clients"))):
        if os.path.isfile(os.path.join(ROOT, "clients", name, "__init__.py")):
            roots[os.path.join("clients", name)] = "ddl." + name
    return roots


def _modules() -> Dict[str, str]:
    """module name -> path, for every module of ddl (stubs left out)."""
    mods = {}
    for root, package in _roots().items():
        top = os.path.join(ROOT, root)
        for dirpath, dirnames, files in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in ("v1", "__pycache__")]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), top)[:-3]
                    parts = [p for p in rel.split(os.sep) if p != "__init__"]
                    mods[".".join([package] + parts)] = os.path.join(dirpath, f)
    return mods


def import_graph() -> Dict[str, Set[str]]:
    """module -> the modules of ddl it imports (anywhere in its code)."""
    mods = _modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps: Set[str] = set()
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                # ``from ddl import _auth`` imports a module; ``from ddl import init``, the
                # package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for target in targets:
                if _under(target, "ddl.v1"):
                    continue  # the stubs import nothing of ours
                # ``import ddl.transports.tcp``: the nearest module of ours
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _reach(graph: Dict[str, Set[str]], starts: Iterable[str]) -> Dict[str, str]:
    """Every module reachable from ``starts`` -> the module that imports it on the way."""
    via: Dict[str, str] = {}
    todo = list(starts)
    while todo:
        m = todo.pop()
        for dep in graph.get(m, ()):
            if dep not in via:
                via[dep] = m
                todo.append(dep)
    return via


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _clients(graph: Dict[str, Set[str]]) -> Set[str]:
    return {m for m in graph if any(_under(m, c) for c in _roots().values()
                                    if c not in ("ddl", "ddl.server"))}


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (lazy imports included):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_graph_counts_imports_inside_functions():
    # ddl/_runtime.py imports the embedded coordinator only inside a function
    assert "ddl.server" in import_graph()["ddl._runtime"]


def test_the_server_imports_only_the_stubs_and_the_shared_core():
    graph = import_graph()
    server = {m for m in graph if _under(m, "ddl.server")}
    bad = {f"{m} imports {dep}" for m in server for dep in graph[m]
           if not _under(dep, "ddl.server") and dep not in SERVER_CORE}
    assert not bad, "the coordinator daemon reaches into the workers' code:\n" + "\n".join(
        sorted(bad))
    # ... and the core does not drag the rest of ddl in behind it
    via = _reach(graph, server)
    bad = {f"{via[m]} imports {m}" for m in via
           if not _under(m, "ddl.server") and m not in SERVER_CORE}
    assert not bad, "the server's shared core imports more of ddl:\n" + "\n".join(sorted(bad))


def test_nothing_in_ddl_imports_a_client():
    graph = import_graph()
    clients = _clients(graph)
    bad = {f"{m} imports {dep}" for m in graph if m not in clients
           for dep in graph[m] if dep in clients}
    assert not bad, "\n".join(sorted(bad))


def test_the_data_plane_reaches_neither_the_runtime_nor_the_public_face():
    graph = import_graph()
    plane = {m for m in graph if any(_under(m, p) for p in DATA_PLANE)}
    assert plane
    via = _reach(graph, plane)
    bad = {f"{via[m]} imports {m}" for m in via if m in RUNTIME | PUBLIC_FACE}
    assert not bad, "the data plane imports upward:\n" + "\n".join(sorted(bad))
