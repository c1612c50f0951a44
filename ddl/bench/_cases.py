"""ddl-bench's cases: what one (op, size, dtype) measures, each rank's input and the result
it must get, exactly (see :mod:`ddl.bench` for the input pattern)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence

import numpy as np

import ddl
from ddl.bench._devices import host_view
from ddl.core.dtypes import BFLOAT16

OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
# --reduce-op (nccl-tests' -o): the reduction of allreduce and reducescatter
REDUCE_OPS = ("sum", "prod", "min", "max")
REDUCING_OPS = ("allreduce", "reducescatter")
# Ops whose buffer is cut into one block per rank: the size is rounded to n elements.
BLOCKED_OPS = ("allgather", "alltoall", "reducescatter")

DTYPES: Dict[str, np.dtype] = {
    "float16": np.dtype(np.float16), "bfloat16": BFLOAT16,
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16), "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
}
# Largest integer m such that every integer in [0, m] is exact in the dtype.
_EXACT_LIMIT = {"float16": 2 ** 11, "bfloat16": 2 ** 8, "float32": 2 ** 24,
                "float64": 2 ** 53}
# Moduli of the input pattern; the largest one whose sums stay exact is used. None is 7,
# the rank stride, so that different ranks always send different values.
_PRIMES = (251, 127, 61, 31, 13, 5, 3, 2)
_RANK_STRIDE = 7


@dataclasses.dataclass(frozen=True)
class Case:
    """One (op, size, dtype) measured on ``n`` ranks, seen from ``rank``."""

    op: str
    nbytes: int      # the size actually used (see _cli.SIZE_HELP)
    count: int       # nbytes / itemsize
    dtype_name: str
    rank: int
    n: int
    reduce_op: str = "sum"   # allreduce and reducescatter: one of REDUCE_OPS

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.dtype_name]

    @property
    def block(self) -> int:
        """Elements per rank block (allgather: each rank's input)."""
        return self.count // self.n

    @property
    def name(self) -> str:
        """The ddl collective name of this case (the same on every rank)."""
        base = f"ddl-bench/{self.op}/{self.dtype_name}/{self.nbytes}"
        return base if self.reduce_op == "sum" else f"{base}/{self.reduce_op}"

    @property
    def product(self) -> bool:
        """Whether the case multiplies (its inputs are 1 + the pattern, see pattern())."""
        return self.reduce_op == "prod" and self.op in REDUCING_OPS


def make_case(op: str, requested: int, dtype_name: str, rank: int, n: int,
              reduce_op: str = "sum") -> Case:
    """The case for a requested size, rounded down to whole elements (or n-blocks)."""
    itemsize = DTYPES[dtype_name].itemsize
    unit = n if op in BLOCKED_OPS else 1
    count = max(unit, requested // itemsize // unit * unit)
    return Case(op, count * itemsize, count, dtype_name, rank, n,
                reduce_op if op in REDUCING_OPS else "sum")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def pattern_modulus(dtype_name: str, n: int, product: bool = False) -> int:
    """Largest prime of ``_PRIMES`` whose n-rank sums of residues (``product``: products
    of 1 + residues) stay exact in the dtype."""
    dtype = DTYPES[dtype_name]
    limit = _EXACT_LIMIT.get(dtype_name) or int(np.iinfo(dtype).max)
    for prime in _PRIMES:
        if (prime ** n if product else (prime - 1) * n) <= limit:
            return prime
    return 1


def pattern(rank: int, count: int, case: Case) -> np.ndarray:
    """Rank ``rank``'s input values as int64: ``(i + 7 * rank) mod p`` (a product case:
    ``1 +`` that, so that no product is zero; where no prime keeps n-rank products exact,
    2 at the elements ``i`` with ``i mod n == rank`` and 1 elsewhere, so that each
    element's product is 2, from one rank, and a lost or extra factor shows)."""
    i = np.arange(count, dtype=np.int64)
    if not case.product:
        return (i + _RANK_STRIDE * rank) % pattern_modulus(case.dtype_name, case.n)
    modulus = pattern_modulus(case.dtype_name, case.n, True)
    if modulus <= 2:
        return 1 + (i % case.n == rank)
    return 1 + (i + _RANK_STRIDE * rank) % modulus


def make_input(case: Case) -> np.ndarray:
    """This rank's input buffer of ``case``."""
    count = case.block if case.op == "allgather" else case.count
    return pattern(case.rank, count, case).astype(case.dtype)


def expected_output(case: Case) -> np.ndarray:
    """The result this rank must get: :func:`exact_output` in the case's dtype."""
    return exact_output(case).astype(case.dtype)


def exact_output(case: Case) -> np.ndarray:
    """The result this rank must get, as exact int64 values."""
    ranks = range(case.n)
    r, block = case.rank, case.block
    combine = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[case.reduce_op]
    if case.op in REDUCING_OPS:
        exact = combine([pattern(s, case.count, case) for s in ranks], axis=0)
        if case.op == "reducescatter":
            exact = exact[r * block:(r + 1) * block]
    elif case.op == "allgather":
        exact = np.concatenate([pattern(s, block, case) for s in ranks])
    elif case.op == "broadcast":
        exact = pattern(0, case.count, case)
    elif case.op == "alltoall":
        exact = np.concatenate([pattern(s, case.count, case)[r * block:(r + 1) * block]
                                for s in ranks])
    else:
        raise ValueError(f"unknown op {case.op!r}")
    return exact


def same(result: Any, expected: np.ndarray) -> bool:
    """Whether ``result`` has ``expected``'s dtype and shape and exactly its bytes (a torch
    tensor, on any device, is read back to the host first)."""
    result = host_view(result)
    if result.dtype != expected.dtype or result.shape != expected.shape:
        return False
    return np.array_equal(np.ascontiguousarray(result).view(np.uint8),
                          np.ascontiguousarray(expected).view(np.uint8))


def op_cases(op: str, sizes: Sequence[int], dtype_name: str,
             reduce_op: str = "sum") -> List[Case]:
    """This rank's cases of ``op``, in the order of ``sizes``; requested sizes that round
    to the same size make one case."""
    cases: Dict[int, Case] = {}
    for size in sizes:
        case = make_case(op, size, dtype_name, ddl.rank(), ddl.size(), reduce_op)
        cases.setdefault(case.nbytes, case)
    return list(cases.values())
