"""α and β of a data path, fitted from ``ddl-bench --csv`` rows.

Each row is an allreduce of ``size`` bytes on ``ranks`` ranks that took ``time_us``. The
algorithm that ran is known (``cost(size, ranks)`` gives its latency steps and the
bytes each β multiplies, see :mod:`.model`). α comes from the small rows (up to
``SMALL_BYTES``, where the bytes are negligible): the median of time / steps. β comes
from the large rows (from ``LARGE_BYTES``): the least-squares slope of the time left
after the latency term against the bytes. Mid-size rows are left to show how well the
two ends describe them (:func:`residuals`).
"""

from __future__ import annotations

import csv
from typing import Callable, Dict, Iterable, List, Tuple

import numpy as np

from .model import Link

Row = Dict[str, str]


def read_rows(path: str) -> List[Row]:
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r["op"] == "allreduce" and r["check"] == "ok"]


SMALL_BYTES = 1024
LARGE_BYTES = 1 << 20


def fit(rows: Iterable[Row], cost: Callable[[int, int], Tuple[float, float]]) -> Link:
    """The Link of ``rows`` (see the module doc)."""
    rows = list(rows)
    small = [float(r["time_us"]) * 1e-6 / cost(int(r["size"]), int(r["ranks"]))[0]
             for r in rows if int(r["size"]) <= SMALL_BYTES]
    large = [r for r in rows if int(r["size"]) >= LARGE_BYTES]
    if not small or len(large) < 2:
        raise ValueError(f"need rows up to {SMALL_BYTES} B and two from {LARGE_BYTES} B")
    alpha = float(np.median(small))
    x, y = [], []
    for r in large:
        steps, nbytes = cost(int(r["size"]), int(r["ranks"]))
        x.append(nbytes)
        y.append(float(r["time_us"]) * 1e-6 - steps * alpha)
    beta = float(np.dot(x, y) / np.dot(x, x))  # through the origin: α is already out
    return Link(alpha=alpha, beta=max(beta, 1e-15))


def residuals(rows: Iterable[Row], cost: Callable[[int, int], Tuple[float, float]],
              link: Link) -> List[Tuple[int, float, float]]:
    """(size, measured µs, modelled µs) per row."""
    out = []
    for r in rows:
        steps, nbytes = cost(int(r["size"]), int(r["ranks"]))
        out.append((int(r["size"]), float(r["time_us"]),
                    (steps * link.alpha + nbytes * link.beta) * 1e6))
    return out


def shared_memory_cost(size: int, p: int) -> Tuple[float, float]:
    """ddl's shared-memory allreduce (model.shared_memory_allreduce)."""
    return 2.0, 2 * (p - 1) / p * size


def tcp_cost(small_message_bytes: int) -> Callable[[int, int], Tuple[float, float]]:
    """ddl's TCP allreduce: recursive doubling up to ``small_message_bytes``
    (DDL_SMALL_MESSAGE_BYTES), the ring above it."""
    def cost(size: int, p: int) -> Tuple[float, float]:
        if size <= small_message_bytes:
            rounds = max(1, (p - 1).bit_length())
            return float(rounds), rounds * float(size)
        return 2.0 * (p - 1), 2 * (p - 1) / p * size
    return cost
