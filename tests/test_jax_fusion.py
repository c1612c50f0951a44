"""DistributedOptimizer's fused allreduce inside ``jax.jit`` leaves the backward pass
alone: in the compiled step, the fusion that concatenates the gradients into the one
buffer computes nothing (no reduce, dot or convolution fused into its loop, where XLA runs
them as slow element-wise loops). In the JAX environment (``.venv-jax``); skips without."""

from __future__ import annotations

import os
import subprocess

import pytest

from test_launcher_support import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv-jax", "bin", "python")

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".venv-jax", ".installed")),
    reason="the JAX environment (.venv-jax, Python >= 3.12) is not there")

SCRIPT = r"""
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
    env = job_env(tmp_path)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    r = subprocess.run([PYTHON, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=100, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "FUSION OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
