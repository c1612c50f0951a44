"""The docs that are made from the code stay true: docs/api.md is what docs/gen_api.py
writes from the docstrings, every public function and class has a docstring, and the
migration guide from Horovod names only what exists."""

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import gen_api  # noqa: E402


def test_the_api_reference_is_current():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        assert f.read() == gen_api.render(), \
            "docs/api.md is stale: run python docs/gen_api.py > docs/api.md"


def test_every_public_function_and_class_says_what_it_does():
    missing = []
    for module in gen_api.MODULES:
        for name in gen_api.exported(module):
            found = gen_api.definition(module, name)
            assert found is not None, f"{module}.{name} is in __all__ but defined nowhere"
            node = found[1]
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not ast.get_docstring(node):
                missing.append(f"{module}.{name} ({found[0]})")
    assert not missing, f"public names without a docstring: {missing}"


def test_the_generator_runs_as_documented():
    out = subprocess.run([sys.executable, "docs/gen_api.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == gen_api.render(), out.stderr


def test_the_migration_guide_names_only_what_exists():
    """Every ``hvd.NAME`` in the ddl column of docs/migrating-from-horovod.md (or in the
    Horovod column, where the ddl one says "the same") is exported by ddl or a client
    (``hvd.callbacks.X`` by ddl.keras.callbacks)."""
    with open(os.path.join(ROOT, "docs", "migrating-from-horovod.md")) as f:
        rows = [line.split(" | ") for line in f if line.startswith("| ") and " | " in line]
    names = set()
    for module in gen_api.MODULES:
        names.update(gen_api.exported(module))
    callbacks = {n.name for n in gen_api._tree("ddl.keras.callbacks").body
                 if isinstance(n, ast.ClassDef)}
    # a row whose ddl column says "the same" cites the Horovod column's names
    cited = {m for row in rows if len(row) >= 2
             for m in re.findall(r"hvd\.([A-Za-z_][\w.]*\w)",
                                 row[0] if row[1].startswith("the same") else row[1])}
    assert cited, rows
    missing = [c for c in cited if c.split(".")[0] not in names
               or (c.startswith("callbacks.") and c.split(".")[1] not in callbacks | {"*"})]
    assert not missing, f"the guide names what ddl does not have: {missing}"
