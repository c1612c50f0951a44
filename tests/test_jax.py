"""ddl.jax in its own environment (``make setup-jax``: JAX 0.11 and later need Python >=
3.12): one 2-rank world of checks (tests/_jax_checks.py: every collective eagerly and
inside jax.jit, gradients, the optax numerical contract, broadcasts of flax and optax
state, the errors, the collective contract over jax.Array), one process without a job
for what needs none, and the compiled training step. Skips, saying why, where the
environment was not made; tests/test_examples_jax.py runs the examples with the same
helpers."""

from __future__ import annotations

import os
import subprocess

import pytest

from test_launcher_support import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JBIN = os.path.join(ROOT, ".venv-jax", "bin")
PYTHON = os.path.join(JBIN, "python")

def _why_not() -> str:
    """Why the JAX environment is not there (make says so when it cannot build it)."""
    try:
        with open(os.path.join(ROOT, ".venv-jax", ".unavailable")) as f:
            return f"the JAX environment could not be made: {f.read().strip()}"
    except FileNotFoundError:
        return "the JAX environment is not there: make setup-jax"


pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".venv-jax", ".installed")), reason=_why_not())


def run_jax(args, tmp_path, timeout=180):
    """``args`` in the JAX environment (its ddlrun first on PATH), from the repository."""
    env = job_env(tmp_path, DDL_STALL_CHECK_TIME_SECONDS="15",
                  DDL_STALL_SHUTDOWN_TIME_SECONDS="60")
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    env["PATH"] = JBIN + os.pathsep + env.get("PATH", "")
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(240)
def test_jax_checks_in_a_two_rank_world(tmp_path):
    r = run_jax([os.path.join(JBIN, "ddlrun"), "-np", "2", PYTHON, "tests/_jax_checks.py",
                 str(tmp_path)], tmp_path)
    assert r.returncode == 0 and "[0]<stdout>:JAX CHECKS OK" in r.stdout, \
        r.stdout[-4000:] + r.stderr[-3000:]


SINGLE = r"""
import sys
import ddl
assert "jax" not in sys.modules, "import ddl imported JAX"
import jax, jax.numpy as jnp, numpy as np
import ddl.jax as hvd
try:
    hvd.allreduce(jnp.ones(2))
except hvd.NotInitializedError as e:
    assert "ddl.jax.allreduce" in str(e) and "init()" in str(e), e
else:
    raise AssertionError("no NotInitializedError before init")
try:
    jax.jit(lambda v: hvd.allreduce(v, name="x"))(jnp.ones(2))
except hvd.NotInitializedError:
    pass
else:
    raise AssertionError("no NotInitializedError inside jit before init")
hvd.init()  # one process, no launcher: a job of one
x = jnp.arange(4096, dtype=jnp.float32)
y = hvd.allreduce(x, name="one", op=hvd.Sum)
assert isinstance(y, jax.Array) and np.array_equal(y, x) and y.devices() == x.devices()
# ddl's results of a page or more are aligned so that JAX adopts them without a copy
from ddl.runtime.results import RESULTS
host = RESULTS.empty(4096, np.float32)
adopted = hvd.JaxAdapter().from_numpy(host, x)
assert adopted.unsafe_buffer_pointer() == host.ctypes.data, "the result was copied"
assert np.shares_memory(hvd.JaxAdapter().to_numpy(x), np.asarray(x))  # and read in place
print("SINGLE OK", sys.version_info[:2], jax.__version__)
"""  # and no ddl.shutdown(): the exit hook must end the job cleanly (on Python 3.12 too)


@pytest.mark.timeout(120)
def test_jax_without_a_launcher_and_exit_without_shutdown(tmp_path):
    r = run_jax([PYTHON, "-c", SINGLE], tmp_path)
    assert r.returncode == 0 and "SINGLE OK (3, 1" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr


# DistributedOptimizer's fused allreduce inside jax.jit leaves the backward pass alone: in
# the compiled step, the fusion that concatenates the gradients into the one buffer
# computes nothing (no reduce, dot, convolution or transpose fused into its loop, where XLA
# runs them element by element: a small CNN's step took 1.9x as long).
FUSION = r"""
import re, sys
sys.path.insert(0, "examples")
import jax, jax.numpy as jnp, optax
import ddl.jax as ddl
import jax_synthetic_benchmark as bench

ddl.init()
params = bench.init_params("cnn", 1024, jax.random.key(0))
tx = ddl.DistributedOptimizer(optax.sgd(0.1))

@jax.jit
def step(p, s, x, y):
    g = jax.grad(bench.loss_fn)(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

hlo = step.lower(params, tx.init(params), jnp.ones((32, 784)),
                 jnp.zeros((32,), jnp.int32)).compile().as_text()
fusions = [c for c in re.split(r"\n(?=\S)", hlo) if " concatenate(" in c]
grads = [c for c in fusions if "-> f32[596042]" in c.splitlines()[0]]
assert grads, "no fusion builds the gradients' buffer: " + str([c[:200] for c in fusions])
for c in grads:
    ops = set(re.findall(r"= \S+ ([a-z\-]+)\(", c))
    assert not ops & {"reduce", "dot", "convolution", "transpose"}, (c.splitlines()[0], ops)
print("FUSION OK")
ddl.shutdown()
"""



@pytest.mark.timeout(120)
def test_fused_allreduce_does_not_pull_the_backward_pass_into_the_concatenation(tmp_path):
    r = run_jax([PYTHON, "-c", FUSION], tmp_path, timeout=100)
    assert r.returncode == 0 and "FUSION OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
