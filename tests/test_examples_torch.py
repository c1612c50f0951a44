"""The PyTorch examples run under ``ddlrun -np 2`` for a few steps."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys

import numpy as np
import importlib.util

import pytest

if importlib.util.find_spec("torch") is None:  # (not imported here: the ranks do)
    pytest.skip("the PyTorch examples need torch (pip install torch)", allow_module_level=True)

from test_launcher_support import ddlrun, job_env  # noqa: E402
from test_bench import rank_lines  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples")


def _write_idx(path: str, arr: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    opener = gzip.open if gz else open
    with opener(path + (".gz" if gz else ""), "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def _fake_mnist(directory) -> None:
    """A tiny MNIST in the real file format (IDX; the training set gzipped)."""
    rng = np.random.default_rng(0)
    for prefix, n, gz in (("train", 256, True), ("t10k", 64, False)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for k in range(10):
            images[labels == k, 2 + 2 * k:4 + 2 * k, :] += 180
        _write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), images, gz)
        _write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), labels, gz)


@pytest.mark.timeout(120)
def test_pytorch_mnist_synthetic_and_from_files(tmp_path):
    ck = tmp_path / "ck"
    r = ddlrun(["-np", "2", sys.executable, os.path.join(EXAMPLES, "pytorch_mnist.py"),
                "--epochs", "2", "--max-steps", "8", "--checkpoint-dir", str(ck)],
               job_env(tmp_path), timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = rank_lines(r.stdout, 0)
    assert "synthetic MNIST-shaped data set" in lines[0]
    assert [ln for ln in lines if re.match(r"epoch [12]: 8 steps in .* test accuracy", ln)]
    assert any(re.match(r"epoch 1: 8/8 steps \(100%\)", ln) for ln in lines), lines
    assert rank_lines(r.stdout, 1) == [], "only rank 0 prints"
    assert sorted(os.listdir(ck)) == ["checkpoint-1.pt", "checkpoint-2.pt"]

    data = tmp_path / "mnist"
    data.mkdir()
    _fake_mnist(str(data))
    r = ddlrun(["-np", "2", sys.executable, os.path.join(EXAMPLES, "pytorch_mnist.py"),
                "--epochs", "1", "--data-dir", str(data)], job_env(tmp_path), timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = rank_lines(r.stdout, 0)
    assert lines[0] == (f"training on MNIST from {data}: 128 examples per rank, 2 rank(s)")
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", "\n".join(lines)).group(1))
    assert 0 <= accuracy <= 100


@pytest.mark.timeout(120)
def test_pytorch_synthetic_benchmark_with_its_baselines(tmp_path):
    r = ddlrun(["-np", "2", sys.executable,
                os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py"), "--compare",
                "ddp,local,alone", "--num-warmup-batches", "2", "--num-batches-per-iter", "2",
                "--num-iters", "2", "--rounds", "1"], job_env(tmp_path), timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    text = "\n".join(rank_lines(r.stdout, 0))
    assert "model: mlp, 1.07 M parameters; batch size 32 per rank; 2 rank(s)" in text
    totals = {}
    for label in ("ddl", "ddp", "local"):
        per = float(re.search(rf"{label}: img/sec per rank: ([\d.]+)", text).group(1))
        totals[label] = float(re.search(rf"{label}: total img/sec on 2 rank\(s\): ([\d.]+)",
                                        text).group(1))
        assert per > 0 and abs(totals[label] - 2 * per) < 0.2, text
    totals["alone"] = float(re.search(r"alone: img/sec of one process: ([\d.]+)",
                                      text).group(1))
    assert totals["alone"] > 0, text
    for label in ("ddp", "local", "alone"):  # each ratio is ddl's total over that one's
        ratio = float(re.search(rf"ddl / {label}: (\d+\.\d\d)", text).group(1))
        assert abs(ratio - totals["ddl"] / totals[label]) < 0.01, (label, text)
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py"),
                        "--compare", "ddp,gloo"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and ("unknown baseline gloo: choose from ddp, local, alone"
                                  in r.stderr), r.stderr


def test_pytorch_synthetic_benchmark_on_cuda_says_when_there_is_no_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: tests/gpu runs the example there")
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py"),
                        "--device", "cuda"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--device cuda: torch sees no CUDA device here" in r.stderr, r.stderr
