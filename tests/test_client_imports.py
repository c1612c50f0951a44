"""Framework clients use ddl's public API and ddl._client_api, no other private module.

``ddl._client_api`` is the documented surface for integrations; a client reaching into
another private module (``ddl._dtypes``, ``ddl._process_sets``, ...) ties it to internals
that may move. This scans the clients' source (no framework needs to be installed).
"""

import ast
from pathlib import Path

CLIENTS = Path(__file__).resolve().parent.parent / "clients"
ALLOWED_PRIVATE = {"ddl._client_api"}


def _private_ddl_imports(path: Path):
    """``(line, module)`` for every import of a private ``ddl`` module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from ddl import _x`` names a private module (or private name) too
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                       if a.name.startswith("_")]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "ddl" or module in ALLOWED_PRIVATE:
                continue
            # private: any part after "ddl" starting with "_", except a client's own
            # package (ddl.torch._ops is the torch client's own module)
            if len(parts) > 1 and parts[1] in {"torch", "tensorflow", "keras", "mxnet"}:
                continue
            if any(p.startswith("_") for p in parts[1:]):
                found.append((node.lineno, module))
    return found


def test_clients_import_only_public_ddl_or_client_api():
    files = sorted(CLIENTS.rglob("*.py"))
    assert files, f"no client sources under {CLIENTS}"
    bad = [f"{f.relative_to(CLIENTS.parent)}:{line}: {module}"
           for f in files for line, module in _private_ddl_imports(f)]
    assert not bad, ("clients import private ddl modules; use `ddl` or ddl._client_api "
                     "(add what a client needs there):\n" + "\n".join(bad))


def test_scan_sees_a_private_import(tmp_path):
    """The scanner itself flags the forms a private import can take."""
    src = tmp_path / "m.py"
    src.write_text("import ddl._dtypes\nfrom ddl._errors import DDLError\n"
                   "from ddl import _runtime\nfrom ddl.launcher import _spawn\n"
                   "from ddl._client_api import BFLOAT16\nfrom ddl import ReduceOp\n"
                   "from ddl.torch._ops import allreduce\n")
    assert [m for _, m in _private_ddl_imports(src)] == [
        "ddl._dtypes", "ddl._errors", "ddl._runtime", "ddl.launcher._spawn"]
