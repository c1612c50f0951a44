"""MNIST for the examples: the four IDX files from ``--data-dir``, or a synthetic set.

``load(data_dir)`` returns ``((x_train, y_train), (x_test, y_test), source)``: float32
images in [0, 1] of shape (N, 28, 28), int64 labels, and a sentence saying where they
came from. Without a directory the images are random, with the label encoded as a bright
band of rows, so a model still has something to learn.
"""

from __future__ import annotations

import gzip
import os
from typing import Optional

import numpy as np


def _idx(path: str) -> np.ndarray:
    """An IDX file (MNIST's format), gzipped or not."""
    for candidate in (path, path + ".gz"):
        if os.path.exists(candidate):
            opener = gzip.open if candidate.endswith(".gz") else open
            with opener(candidate, "rb") as f:
                data = f.read()
            ndim = data[3]
            shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
            return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
    raise FileNotFoundError(f"{path}[.gz] not found")


def _from_files(data_dir: str):
    def pair(prefix):
        x = _idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte"))
        y = _idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte"))
        return x.astype(np.float32) / 255.0, y.astype(np.int64)
    return pair("train"), pair("t10k")


def _synthetic(n_train: int = 6000, n_test: int = 1000):
    rng = np.random.default_rng(1234)

    def make(n):
        y = rng.integers(0, 10, n)
        x = rng.random((n, 28, 28), dtype=np.float32) * 0.3
        for k in range(10):
            x[y == k, 2 + 2 * k:4 + 2 * k, :] += 0.7
        return x, y.astype(np.int64)
    return make(n_train), make(n_test)


def load(data_dir: Optional[str]):
    if data_dir:
        train, test = _from_files(data_dir)
        return train, test, f"MNIST from {data_dir}"
    train, test = _synthetic()
    return train, test, "a synthetic MNIST-shaped data set (no --data-dir given)"
