"""The JAX examples, briefly, under the JAX environment's ``ddlrun -np 2`` (``.venv-jax``:
JAX needs Python >= 3.12): the flax nnx MNIST example, and the synthetic benchmark next to
JAX's own multi-process collectives (training and the allreduce table). Output shape only,
never speed. Skips, saying why, where the environment was not made."""

from __future__ import annotations

import os
import re

import pytest

from test_bench import rank_lines
from test_jax import JBIN, PYTHON, pytestmark, run_jax  # noqa: F401 (the skip marker)


def _run(args, tmp_path, timeout=180):
    return run_jax([os.path.join(JBIN, "ddlrun"), "-np", "2", PYTHON, *args], tmp_path,
                   timeout)


@pytest.mark.timeout(240)
def test_jax_mnist(tmp_path):
    ck = tmp_path / "ck"
    r = _run(["examples/jax_mnist.py", "--max-steps", "10", "--checkpoint-dir", str(ck)],
             tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = rank_lines(r.stdout, 0)
    assert lines[0] == ("training on a synthetic MNIST-shaped data set (no --data-dir "
                        "given): 3000 examples per rank, 2 rank(s)"), lines
    assert any(re.match(r"epoch 1: 10/10 steps \(100%\), loss [\d.]+$", ln) for ln in lines)
    for epoch in (1, 2):
        assert [ln for ln in lines if re.match(
            rf"epoch {epoch}: 10 steps in .* test loss [\d.]+, test accuracy [\d.]+%$", ln)], \
            lines
    assert rank_lines(r.stdout, 1) == [], "only rank 0 prints"
    assert sorted(os.listdir(ck)) == ["checkpoint-1.npz", "checkpoint-2.npz"]


@pytest.mark.timeout(240)
def test_jax_synthetic_benchmark_with_jax_own_collectives(tmp_path):
    r = _run(["examples/jax_synthetic_benchmark.py", "--compare", "jax", "--width", "256",
              "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", "2",
              "--rounds", "1"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = "\n".join(rank_lines(r.stdout, 0))
    assert "model: mlp, 0.22 M parameters; batch size 32 per rank; 2 rank(s)" in text, text
    for label in ("ddl", "jax"):
        per = float(re.search(rf"{label}: img/sec per rank: ([\d.]+)", text).group(1))
        total = float(re.search(rf"{label}: total img/sec on 2 rank\(s\): ([\d.]+)",
                                text).group(1))
        assert per > 0 and abs(total - 2 * per) < 0.2, text
    assert re.search(r"ddl / jax: \d+\.\d\d$", text, re.M), text

    r = _run(["examples/jax_synthetic_benchmark.py", "--compare", "jax", "--allreduce-only",
              "--sizes", "4,65536", "--iters", "2", "--rounds", "1"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = rank_lines(r.stdout, 0)
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["size", "(B)"])
    rows = [ln.split() for ln in lines[header + 1:]]
    assert [row[0] for row in rows] == ["4", "65536"], lines
    assert all(len(row) == 8 and float(row[1]) > 0 and float(row[4]) > 0 for row in rows), \
        lines
