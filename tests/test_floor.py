"""The oldest supported Python, grpcio and protobuf: a 2-rank job and the keepalive
checks that set the grpcio floor, in ``.venv-floor`` (``make setup-floor``: exactly the
``>=`` floors of pyproject.toml, on its oldest Python where the machine has one, and ddl
editable without its dependencies), while the rest of the suite runs on the newest
versions. Skips, saying why, where the environment was not made."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from test_launcher_support import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLBIN = os.path.join(ROOT, ".venv-floor", "bin")
PYTHON = os.path.join(FLBIN, "python")

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".venv-floor", ".installed")),
    reason="the oldest-versions environment is not there: make setup-floor")


def _floors() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    found = dict(re.findall(r'"(grpcio|protobuf)>=([0-9.]+),', text))
    found.update(re.findall(r'^requires-(python) = ">=([0-9.]+)"', text, re.M))
    return found


def _run(args, tmp_path, timeout=120):
    env = job_env(tmp_path, DDL_STALL_CHECK_TIME_SECONDS="15",
                  DDL_STALL_SHUTDOWN_TIME_SECONDS="60")
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    env["PATH"] = FLBIN + os.pathsep + env.get("PATH", "")
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(240)
def test_a_job_runs_on_the_oldest_supported_grpcio_and_protobuf(tmp_path):
    floors = _floors()
    assert set(floors) == {"grpcio", "protobuf", "python"}, floors
    r = _run([PYTHON, "-c",
              "import grpc, google.protobuf, ddl, ddl.server, ddl.v1.coordinator_pb2_grpc; "
              "print(grpc.__version__, google.protobuf.__version__, ddl.__file__)"], tmp_path)
    assert r.returncode == 0, r.stderr
    grpc_v, protobuf_v, where = r.stdout.split()
    # the environment holds the floors themselves (a stale one: make setup-floor again)
    assert (grpc_v, protobuf_v) == (floors["grpcio"], floors["protobuf"]), r.stdout
    assert where.startswith(ROOT), where
    # and they satisfy what ddl declares
    r = _run([PYTHON, "-m", "pip", "check"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run([os.path.join(FLBIN, "ddlrun"), "-np", "2", PYTHON, "examples/numpy_allreduce.py"],
             tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("-> OK") == 2, r.stdout


@pytest.mark.timeout(240)
def test_keepalive_answers_while_the_gil_is_held_on_the_oldest_grpcio(tmp_path):
    # what set the grpcio floor: up to grpcio 1.78, a process holding the GIL in a C call
    # left keepalive pings unanswered and was reported lost
    r = _run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/test_liveness.py", "-k", "holding_the_gil"], tmp_path, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\b2 passed\b", r.stdout), r.stdout


# parses every .py file under the folders given, writing nothing (compileall would leave
# .pyc files in the tree)
_COMPILE_ALL = """
import os, sys
bad, count = [], 0
for top in sys.argv[1:]:
    for folder, _, files in os.walk(top):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                count += 1
                try:
                    compile(open(path, encoding="utf-8").read(), path, "exec")
                except SyntaxError as exc:
                    bad.append(f"{path}:{exc.lineno}: {exc.msg}")
print("\\n".join(bad) if bad else f"compiled {count} files")
sys.exit(1 if bad else 0)
"""


@pytest.mark.timeout(240)
def test_every_module_compiles_and_a_job_runs_on_the_oldest_supported_python(tmp_path):
    want = _floors()["python"]
    r = _run([PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], tmp_path)
    have = r.stdout.strip()
    if have != want:
        pytest.skip(f"no Python {want} on this machine (requires-python's floor): "
                    f".venv-floor runs {have} (make setup-floor FL_PYTHON=...)")
    # every module of ddl, its server and clients parses on it (a job imports only some)
    r = _run([PYTHON, "-c", _COMPILE_ALL, "ddl", "server", "clients", "examples", "tools",
              "tests"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("compiled "), r.stdout + r.stderr
    # and the job above ran on it (the first test); here a world of one, every collective
    r = _run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/test_world.py"], tmp_path, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
