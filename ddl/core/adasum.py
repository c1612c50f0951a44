"""Adasum: adaptive summation of the members' tensors (Maleki et al., "Scaling
Distributed Training with Adaptive Summation", MLSys 2021; Horovod's ``op=hvd.Adasum``).

Two vectors combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so identical vectors give that vector, orthogonal ones their sum, and a zero vector gives
its partner unchanged (the zero vector is the neutral element: a rank that called
:func:`ddl.join` contributes zeros). The members' vectors combine up a binary tree in
member order: level 0 pairs members (0, 1), (2, 3), ...; each later level pairs the
previous level's results the same way. When a level has an odd count (the number of
members is not a power of two), its last vector is carried up to the next level
unchanged; Horovod requires a power of two, ddl does not (with 3 members the result is
``adasum(adasum(x0, x1), x2)``).

A fused buffer holds several tensors: each *segment* (one tensor) combines on its own,
with its own dot products. All arithmetic is in float64 (the dot products are NumPy's
pairwise sums of elementwise products, whose order does not depend on the CPU, so every
rank computes the same bits from the same inputs) and the result is rounded once, into
the wire dtype. This module is pure NumPy: the executor gathers every member's packed
buffer and calls :func:`combine_into` with them in member order on every rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_F64 = np.dtype(np.float64)


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` of two float64 vectors (a new array, or ``a``/``b`` itself when
    the other is zero)."""
    na = float(np.sum(a * a))
    nb = float(np.sum(b * b))
    if na == 0.0:
        return b
    if nb == 0.0:
        return a
    dot = float(np.sum(a * b))
    out = a * (1.0 - dot / (2.0 * na))
    out += b * (1.0 - dot / (2.0 * nb))
    return out


def tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The members' float64 ``vectors`` (member order) combined up the binary tree of the
    module doc; an empty sequence is not allowed."""
    level = list(vectors)
    while len(level) > 1:
        nxt = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])  # the odd one is carried up unchanged
        level = nxt
    return level[0]


def combine_into(parts: Sequence[np.ndarray], segments: Sequence[int],
                 out: np.ndarray) -> np.ndarray:
    """Write the Adasum of ``parts`` (each member's 1-D buffer, member order, all of
    ``sum(segments)`` elements) into ``out`` (1-D, same length, a floating dtype), one
    segment at a time; returns ``out``. ``out`` may be one of ``parts``."""
    start = 0
    for size in segments:
        end = start + int(size)
        if size:
            vectors = [np.asarray(p[start:end], dtype=_F64) for p in parts]
            # asarray may return a float64 part itself: tree() never writes its inputs
            result = tree(vectors)
            np.copyto(out[start:end], result, casting="unsafe")
        start = end
    return out


__all__ = ["pair", "tree", "combine_into"]
