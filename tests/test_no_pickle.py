"""No pickle or marshal on a network path: a grep of the library's source.

These modules may use pickle, each for a stated reason:

* ``ddl/_objects.py``: ``broadcast_object``/``allgather_object``, called by the user for
  Python objects, as in Horovod; the bytes travel only on the job's authenticated data
  plane (HMAC challenge with the job secret), so only the job's own ranks can send them;
* ``ddl/launcher/run_fn.py`` and ``ddl/launcher/_fn_worker.py``: ``ddl.run`` hands the
  function to its own child processes through inherited pipes, never a socket;
* ``ddl/launcher/engine_ranks.py``: a Spark task or Ray actor does the same for its one
  rank, and unpickles the rank's result from that pipe (what then travels back to the
  engine's driver is Spark's or Ray's own serialization, not bytes ddl unpickles).

Everything else (gRPC messages, data-plane headers, MPI bootstrap, ssh launch specs)
is protobuf, fixed binary headers or JSON.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {"ddl/_objects.py", "ddl/launcher/run_fn.py", "ddl/launcher/_fn_worker.py",
           "ddl/launcher/engine_ranks.py"}
PATTERN = re.compile(r"\b(import\s+(c?pickle|marshal|dill|cloudpickle|shelve)"
                     r"|from\s+(c?pickle|marshal|dill|cloudpickle|shelve)\s+import"
                     r"|allow_pickle\s*=\s*True|pickle\.loads?|marshal\.loads?)\b")


def _sources():
    for top in ("ddl", "server", "clients"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if os.sep + "v1" in dirpath:  # generated protobuf stubs
                continue
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def test_no_pickle_or_marshal_outside_the_allowed_modules():
    found = []
    seen = 0
    for rel, path in _sources():
        seen += 1
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                code = line.split("#", 1)[0]
                if PATTERN.search(code) and rel not in ALLOWED:
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert seen > 50, "the walk found too few sources"
    assert not found, "pickle/marshal on a possible network path:\n" + "\n".join(found)
    # the pattern does find what it is for
    assert PATTERN.search("import pickle") and PATTERN.search("x = pickle.loads(b)")
    assert PATTERN.search("np.load(f, allow_pickle=True)")
