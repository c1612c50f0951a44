"""The TensorFlow and Keras examples run under ``ddlrun -np 2`` for a few steps (a
keras.applications model in one process, without ddlrun: the slowest to build)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import importlib.util

import pytest

if importlib.util.find_spec("tensorflow") is None:  # (not imported here: the ranks do)
    pytest.skip("the TensorFlow examples need TensorFlow (pip install -e '.[tensorflow]')",
                allow_module_level=True)

from test_bench import rank_lines  # noqa: E402
from test_examples_torch import EXAMPLES, _fake_mnist  # noqa: E402
from test_launcher_support import ddlrun, job_env  # noqa: E402


def _run(tmp_path, script, *args):
    r = ddlrun(["-np", "2", sys.executable, os.path.join(EXAMPLES, script), *args],
               job_env(tmp_path, TF_CPP_MIN_LOG_LEVEL="3"), timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert rank_lines(r.stdout, 1) == [], "only rank 0 prints"
    return "\n".join(rank_lines(r.stdout, 0))


@pytest.mark.timeout(300)
def test_tensorflow_and_keras_examples(tmp_path):
    data = tmp_path / "mnist"
    data.mkdir()
    _fake_mnist(str(data))
    ck = tmp_path / "keras-ck"
    text = _run(tmp_path, "keras_mnist.py", "--epochs", "2", "--max-steps", "3",
                "--checkpoint-dir", str(ck))
    assert "training on a synthetic MNIST-shaped data set" in text
    assert "1 epoch(s)" in text and re.search(r"test accuracy [\d.]+%", text), text
    assert os.listdir(ck) == ["checkpoint-1.keras"]

    text = _run(tmp_path, "tensorflow2_mnist.py", "--steps", "8", "--data-dir", str(data))
    assert f"training on MNIST from {data}" in text and "step 3: loss" in text, text

    logs = tmp_path / "v1-logs"
    text = _run(tmp_path, "tensorflow_v1_monitored_session.py", "--steps", "8",
                "--checkpoint-dir", str(logs))
    assert re.search(r"final loss [\d.]+", text), text
    assert any(f.startswith("model.ckpt") for f in os.listdir(logs))

    text = _run(tmp_path, "tensorflow2_synthetic_benchmark.py", "--num-warmup-batches", "1",
                "--num-batches-per-iter", "2", "--num-iters", "2", "--scaling")
    assert re.search(r"total img/sec on 2 rank\(s\): [\d.]+", text), text
    assert re.search(r"one rank alone: [\d.]+ img/sec; scaling efficiency on 2 rank\(s\): "
                     r"[\d.]+%", text), text

    # tf_cnn_benchmarks' models from keras.applications, in one process without ddlrun
    bench = os.path.join(EXAMPLES, "tensorflow2_synthetic_benchmark.py")
    r = subprocess.run([sys.executable, bench, "--model", "MobileNetV2", "--image-size", "32", "--batch-size", "2",
                        "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                        "--num-iters", "1"], env=job_env(tmp_path, TF_CPP_MIN_LOG_LEVEL="3"),
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model: MobileNetV2, 3.50 M parameters; batch size 2 per rank; 1 rank(s)" \
        in r.stdout, r.stdout
    assert re.search(r"total img/sec on 1 rank\(s\): [\d.]+", r.stdout), r.stdout

    # the MWMS baseline: a child process per rank, TF_CONFIG from ports the ranks swap
    text = _run(tmp_path, "tensorflow2_synthetic_benchmark.py", "--model", "mlp",
                "--compare", "mwms", "--num-warmup-batches", "1",
                "--num-batches-per-iter", "2", "--num-iters", "2")
    for label in ("ddl", "mwms"):
        assert re.search(rf"{label}: total img/sec on 2 rank\(s\): [\d.]+", text), text
    assert re.search(r"ddl / mwms: [\d.]+", text), text
    # no wait without a deadline: a worker that cannot start in time is killed
    r = ddlrun(["-np", "2", sys.executable,
                os.path.join(EXAMPLES, "tensorflow2_synthetic_benchmark.py"),
                "--model", "mlp", "--compare", "mwms", "--mwms-timeout", "0.1",
                "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                "--num-iters", "2"],
               job_env(tmp_path, TF_CPP_MIN_LOG_LEVEL="3"), timeout=60)
    assert r.returncode != 0 and "--compare mwms failed" in r.stdout + r.stderr, r.stderr
    assert "the MWMS worker did not start within 0.1 s" in r.stdout + r.stderr, r.stderr
