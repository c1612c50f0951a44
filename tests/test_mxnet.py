"""ddl.mxnet in its own environment (``make setup-mxnet``: MXNet 1.9.1 needs numpy
< 1.24): one 2-rank world of checks (every collective and dtype, the collective contract of
tests/_contract_checks.py over NDArrays, the DistributedTrainer contract,
deferred-parameter broadcast, DistributedOptimizer, alone and inside a Gluon Trainer) and
the example, both under that environment's ddlrun. Skips, saying why, where the
environment was not made."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from test_launcher_support import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MXBIN = os.path.join(ROOT, ".venv-mxnet", "bin")
PYTHON = os.path.join(MXBIN, "python")

def _why_not() -> str:
    """Why the MXNet environment is not there (make says so when it cannot build it)."""
    try:
        with open(os.path.join(ROOT, ".venv-mxnet", ".unavailable")) as f:
            return f"the MXNet environment could not be made: {f.read().strip()}"
    except FileNotFoundError:
        return "the MXNet environment is not there: make setup-mxnet"


pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".venv-mxnet", ".installed")), reason=_why_not())


def _run(args, tmp_path, timeout=180):
    env = job_env(tmp_path, DDL_STALL_CHECK_TIME_SECONDS="15",
                  DDL_STALL_SHUTDOWN_TIME_SECONDS="60")
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    env["PATH"] = MXBIN + os.pathsep + env.get("PATH", "")
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(240)
def test_mxnet_checks_and_example(tmp_path):
    r = _run([PYTHON, "-c", "import sys, ddl; import numpy; "
              "assert 'mxnet' not in sys.modules; print(numpy.__version__)"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("1.23."), r.stderr
    r = _run([os.path.join(MXBIN, "ddlrun"), "-np", "2", PYTHON, "tests/_mxnet_checks.py"],
             tmp_path)
    assert r.returncode == 0 and "[0]<stdout>:MXNET CHECKS OK" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]
    ck = tmp_path / "ck"
    r = _run([os.path.join(MXBIN, "ddlrun"), "-np", "2", PYTHON, "examples/mxnet_mnist.py",
              "--max-steps", "10", "--checkpoint-dir", str(ck)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "synthetic MNIST-shaped data set" in r.stdout
    assert re.search(r"\[0\]<stdout>:epoch 2: 10 steps in .* test accuracy", r.stdout)
    assert "[1]<stdout>" not in r.stdout  # only rank 0 prints
    assert sorted(os.listdir(ck)) == ["checkpoint-1.params", "checkpoint-2.params"]
