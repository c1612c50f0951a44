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

# The roles (folders of ddl/, see DESIGN.md "Layout") and what each may import. Anything
# else is an upward or sideways reach; to allow it, change the layering in DESIGN.md first.
ALLOWED = {
    # the small core every process shares: errors, config, auth, limits, dtypes, ...
    "core": {"core"},
    # the coordinator daemon: its own code, the stubs and the core, nothing of the workers
    "server": {"server", "core"},
    # backends -> algorithms -> transports; knows nothing of engines or the public API
    "dataplane": {"dataplane", "core"},
    # bootstrap, MPI, rendezvous, the coordinators a worker starts (embedded: the server)
    "startup": {"startup", "dataplane", "core", "server"},
    # engine, negotiation client, cycles, cache, execution, results, timeline
    "runtime": {"runtime", "startup", "dataplane", "core"},
    # elastic jobs, the worker's side: State objects and the run loop
    "elastic": {"elastic", "face", "runtime", "startup", "core"},
    # ddlrun and ddl.run (whose worker, _fn_worker, calls the public API)
    "launcher": {"launcher", "face", "dataplane", "core"},
    # the public face: ddl/__init__.py and the modules beside it
    "face": {"face", "runtime", "startup", "launcher", "core"},
    # framework clients: the public API and ddl._client_api (test_client_imports.py)
    "clients": {"clients", "face", "elastic"},
    # ddl-bench: a tool on the public face, which also reads MPI start-up, the device
    # views, the data plane's address and the launcher's interface probe; nothing imports it
    "bench": {"bench", "face", "runtime", "startup", "launcher", "core"},
}
ROLE_FOLDERS = {"core", "server", "dataplane", "startup", "runtime", "launcher", "elastic",
                "bench"}


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
                # ``import ddl.dataplane.transports.tcp``: the nearest module of ours
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


def role(module: str, clients: Set[str]) -> str:
    """The role (a key of ALLOWED) of one of ddl's modules."""
    if module in clients:
        return "clients"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ROLE_FOLDERS:
        return parts[1]
    return "face"


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (lazy imports included):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_graph_counts_imports_inside_functions():
    # ddl/startup/embedded.py imports the server only inside a function
    assert "ddl.server" in import_graph()["ddl.startup.embedded"]


def test_every_module_has_a_role_and_every_role_modules():
    graph = import_graph()
    clients = _clients(graph)
    roles = {role(m, clients) for m in graph}
    assert roles == set(ALLOWED), roles ^ set(ALLOWED)
    # the public face is ddl/__init__.py and the modules beside it, no folder
    face = sorted(m for m in graph if role(m, clients) == "face")
    assert all(m.count(".") <= 1 for m in face), face


def test_each_role_imports_only_the_roles_below_it():
    graph = import_graph()
    clients = _clients(graph)
    bad = sorted(f"{m} ({role(m, clients)}) imports {dep} ({role(dep, clients)})"
                 for m in graph for dep in graph[m]
                 if role(dep, clients) not in ALLOWED[role(m, clients)])
    assert not bad, ("imports against the layering (tests/test_layering.py ALLOWED, "
                     "DESIGN.md):\n" + "\n".join(bad))


def test_the_layering_check_finds_an_upward_import():
    clients = {"ddl.torch"}
    assert role("ddl.dataplane.backends.shm", clients) == "dataplane"
    assert role("ddl.core", clients) == "core"
    assert role("ddl._api", clients) == "face" and role("ddl", clients) == "face"
    assert role("ddl.torch", clients) == "clients"
    assert "runtime" not in ALLOWED["dataplane"] and "face" not in ALLOWED["runtime"]


def test_nothing_in_ddl_imports_a_client():
    graph = import_graph()
    clients = _clients(graph)
    bad = {f"{m} imports {dep}" for m in graph if m not in clients
           for dep in graph[m] if dep in clients}
    assert not bad, "\n".join(sorted(bad))
