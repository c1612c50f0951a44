"""Framework clients use ddl's public API and ddl._client_api, no other ddl module.

``ddl._client_api`` is the documented surface for integrations; a client reaching into
ddl's internals (``ddl.core.dtypes``, ``ddl.runtime.engine``, ``ddl._process_sets``, ...)
ties it to code that may move. This scans the clients' source (no framework needs to be
installed).
"""

import ast
from pathlib import Path

CLIENTS = Path(__file__).resolve().parent.parent / "clients"
ALLOWED = {"ddl", "ddl._client_api", "ddl._common_api", "ddl.elastic"}
ENGINES = {"spark", "ray"}  # cluster engines (clients/ too), not framework clients
CLIENT_PACKAGES = {"torch", "tensorflow", "keras", "mxnet", "jax"}


def _private_ddl_imports(path: Path):
    """``(line, module)`` for every import of a private ``ddl`` module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from ddl import _x`` names a private module (or private name) too
            modules = [node.module] + [f"ddl.{a.name}" for a in node.names
                                       if node.module == "ddl" and a.name.startswith("_")]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "ddl" or module in ALLOWED:
                continue
            # a client's own package (ddl.torch._ops is the torch client's own module)
            if len(parts) > 1 and parts[1] in CLIENT_PACKAGES | ENGINES:
                continue
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
    src.write_text("import ddl.core.dtypes\nfrom ddl.core.errors import DDLError\n"
                   "from ddl import _api\nfrom ddl.launcher import _spawn\n"
                   "import ddl.runtime.engine\n"
                   "from ddl._client_api import BFLOAT16\nfrom ddl import ReduceOp\n"
                   "from ddl.torch._ops import allreduce\n")
    assert [m for _, m in _private_ddl_imports(src)] == [
        "ddl.core.dtypes", "ddl.core.errors", "ddl._api", "ddl.launcher",
        "ddl.runtime.engine"]


BUILD_QUERIES = {"mpi_built", "gloo_built", "nccl_built", "cuda_built", "rocm_built",
                 "ccl_built", "sycl_built", "ddl_built"}


def test_every_client_has_the_framework_neutral_api():
    """Every framework client's ``__all__`` holds ddl._common_api's names (Horovod's build
    queries among them, answering without a job), which are ddl's own objects; read from
    the source for the clients, so no framework is needed."""
    import sys
    sys.path.insert(0, str(CLIENTS.parent / "docs"))
    import gen_api

    import ddl
    from ddl import _common_api
    common = set(_common_api.__all__)
    assert BUILD_QUERIES | {"gloo_enabled", "mpi_enabled", "start_timeline", "PeerLostError",
                            "ProcessSet", "Adasum", "join"} <= common <= set(ddl.__all__)
    assert all(getattr(_common_api, n) is getattr(ddl, n) for n in common)
    assert [getattr(ddl, q)() for q in sorted(BUILD_QUERIES - {"mpi_built"})] == [False] * 7
    assert isinstance(ddl.mpi_built(), bool) and ddl.gloo_enabled() is False
    for client in sorted(CLIENT_PACKAGES):
        exported = gen_api.exported(f"ddl.{client}")
        assert len(exported) == len(set(exported)), (client, exported)
        assert common <= set(exported), (client, common - set(exported))
