"""ddl-bench: latency, bandwidth and correctness of every ddl collective, nccl-tests style.

    ddlrun [--mpi] -np 2 ddl-bench --op all --sizes 4,1M,16M [--compare gloo,mpi] [--floor]
                                   [--device cuda [--compare gloo,nccl]] [--csv|--json]

Every rank runs the same cases, one collective per (op, size); rank 0 prints one row per
case. Each case runs ``--warmup`` untimed calls, then a barrier, then ``--iters`` timed
calls. By default (``--timing loop``, as nccl-tests) the timed calls run back to back and
a rank's time is their mean; the row shows the slowest rank's (CSV and JSON also give the
fastest rank's). With ``--timing per-call`` each call is timed alone: a call's time is the
slowest rank's time for that call, and the row shows the median over the calls (CSV and
JSON also give the minimum). Results are compared with the exactly known expected value
(every warm-up call, then every timed call or, in loop timing, one more call after the
loop): inputs are small integers, ``(i + 7 * rank) mod p`` at element ``i`` for a prime
``p`` small enough that every sum is exact in the dtype (``--reduce-op prod``: ``1 +`` that,
for a ``p`` whose products are exact), so a single wrong element makes the row ``WRONG``
and the exit status 1. Reductions are Sum unless ``--reduce-op`` says otherwise (``prod``,
``min``, ``max``, as nccl-tests' ``-o``).

With ``--compare gloo`` torch.distributed is started with the Gloo backend in the same
processes (rank 0 picks a free port on 127.0.0.1 and broadcasts it with ddl), and each
case is run and checked again with the equivalent torch op on ``torch.from_numpy`` views
of the same buffers, right after ddl's block. With ``--compare mpi`` the same is done with
mpi4py on a duplicate of ``MPI.COMM_WORLD``; that needs a job started by MPI
(``ddlrun --mpi`` or ``mpiexec``), whose world must be the ddl job's ranks in the same
order. ``--compare gloo,mpi`` runs both.

With ``--device cuda`` (needs CuPy) the inputs are CuPy arrays on GPU ``local_rank %
device_count`` (ranks may share a GPU), every call returns one, and each timed block ends
when the GPU has finished; ``--compare gloo`` then runs Gloo on torch CUDA tensors of the
same values on the same GPU, and ``--compare nccl`` torch.distributed's NCCL backend on
them (the peer of ``DistributedDataParallel``). NCCL refuses two ranks on one GPU, so
``--compare nccl`` needs a GPU per rank: ranks that share one fail at the start, all with
one message. Results are checked on the host, untimed.

With ``--floor`` each row also gets a physical floor, measured in the same run, and ddl's
time divided by it. Above 64 KiB the copy floor: the time in which every rank copies a
buffer of the row's size once (``np.copyto``), all ranks at once after a barrier
(slowest rank per copy, median over ``--iters`` copies). Up to 64 KiB, where such a copy
times a cold call (about 10 µs after a barrier), not memory, the ping-pong floor: half
the median round trip of a message of the row's size between ranks 0 and 1 through
shared memory.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import mmap
import os
import re
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import numpy as np

import ddl
from ddl.core.dtypes import BFLOAT16
from ddl.core.errors import ConfigError, DDLTimeoutError
from ddl.startup import mpi as _mpi

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
# Dtypes torch's Gloo backend reduces and moves (it rejects int16 and uint16).
GLOO_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32",
               "int64")
# Dtypes with a standard MPI datatype (MPI has none for float16 and bfloat16).
MPI_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64")
# Dtypes NCCL reduces and moves, of those --device cuda makes (CuPy has no bfloat16).
NCCL_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
# --reduce-op's names in torch.distributed.ReduceOp and in mpi4py's MPI
_TORCH_REDUCE_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX"}
_MPI_REDUCE_OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX"}
# Implementations --compare can run beside ddl, in this order.
PEERS = ("gloo", "mpi", "nccl")
# calls per case by default: many for small cases, few for large ones
SMALL_CASE_BYTES = 64 * 1024
SMALL_ITERS, SMALL_WARMUP = 1000, 100
LARGE_ITERS, LARGE_WARMUP = 20, 5
# --floor: the copy floor above this size (a smaller copy times a cold call), the
# shared-memory ping-pong floor up to it.
FLOOR_MIN_BYTES = SMALL_CASE_BYTES
PINGPONG_TIMEOUT_S = 30.0  # a whole ping-pong block, warm-up included
_LINE = 64  # bytes: each ping-pong flag on its own cache line
_SUFFIX = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}

SIZE_HELP = """\
what SIZE means (nccl-tests convention: the total buffer size, in bytes):
  allreduce      the buffer each rank reduces (input = output size)
  allgather      the gathered output; each rank contributes SIZE/n
  broadcast      the buffer broadcast from rank 0
  alltoall       each rank's send buffer (= its receive buffer); SIZE/n to each rank
  reducescatter  each rank's input; each rank receives SIZE/n
Sizes are rounded down to whole elements (whole n-element blocks for allgather,
alltoall and reducescatter), at least one element per rank; the table shows the size
actually used, and sizes that round to the same one run once. count = size / element
size (allgather: elements gathered).

algbw = size / time; busbw = algbw * factor, as in nccl-tests:
  allreduce 2(n-1)/n; allgather, reducescatter, alltoall (n-1)/n; broadcast 1.

time is in microseconds. --timing loop (default): the mean over --iters calls made back
to back, on the slowest rank (CSV/JSON min: the fastest rank's). --timing per-call: for
each timed call the slowest rank's time, and the median over the calls (CSV/JSON min:
the fastest call). A barrier precedes each block of timed calls, not each call.
Reductions use Sum (--reduce-op: prod, min or max); broadcast's root is rank 0.

output: a table on rank 0's stdout (rows appear as they are measured), or CSV (--csv)
or JSON (--json: a list of row objects with the CSV's fields); --output PATH writes it
to PATH instead of stdout. Exit status: 0 if every result was correct, 1 if any was
WRONG, 2 for bad arguments.

--compare gloo / mpi / nccl, or several (gloo,mpi): each case runs again, right after
ddl's block, with torch.distributed Gloo, mpi4py or torch.distributed NCCL on the same
input, checked the same way; the columns PEER(us), PEER_check and PEER/ddl (> 1: ddl is
faster) follow ddl's. mpi needs a job started by MPI: ddlrun --mpi -np N ddl-bench ...
or mpiexec -n N ddl-bench ...; nccl needs --device cuda and a GPU per rank.

--floor: a physical floor per row, floor(us), and ddl/floor = ddl's time / floor.
  floor copy (above 64 KiB): every rank copies SIZE bytes once (np.copyto), all ranks
    at once after a barrier; the slowest rank per copy, the median over --iters copies
  floor pingpong (up to 64 KiB, where a copy would time a cold call): ranks 0 and 1
    bounce SIZE bytes through shared memory, spinning on a flag in Python; half the
    median round trip (n/a with one rank or ranks on several hosts)

examples:
  ddlrun -np 2 ddl-bench --op all --sizes 4,1M,16M --compare gloo
  ddlrun --mpi -np 2 ddl-bench --op allreduce --sizes 4,64K,1M,16M --compare gloo,mpi --floor
"""


# -- command line --------------------------------------------------------------------------

def _is_rank0() -> bool:
    """Whether this process is rank 0 (or not under a launcher), before ``ddl.init()``:
    ddlrun's ``DDL_RANK``, else the MPI or Slurm launcher's rank."""
    if "DDL_RANK" in os.environ:
        return os.environ["DDL_RANK"] == "0"
    try:
        launcher = _mpi.detect()
    except ConfigError:
        return True
    return launcher is None or launcher.rank == 0


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that prints help and errors on rank 0 only (exit codes stay)."""

    def _print_message(self, message: str, file: Optional[TextIO] = None) -> None:
        if _is_rank0():
            super()._print_message(message, file)


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional K, M or G suffix (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text, re.IGNORECASE)
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a positive integer with an optional K, M or G "
            f"suffix, e.g. 4, 64K, 1M")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


def parse_size_list(text: str) -> List[int]:
    """Sizes of a comma-separated list such as ``4,64K,1M``."""
    return [parse_size(part) for part in text.split(",")]


def parse_ops(text: str) -> List[str]:
    """Ops of a comma-separated list, or every op for ``all``; order kept, no repeats."""
    names = [part.strip().lower() for part in text.split(",")]
    if names == ["all"]:
        return list(OPS)
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown op {unknown[0]!r}: choose from {', '.join(OPS)} or all")
    return list(dict.fromkeys(names))


def parse_peers(text: str) -> List[str]:
    """Implementations of a comma-separated ``--compare`` list; order kept, no repeats."""
    names = [part.strip().lower() for part in text.split(",")]
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown implementation {unknown[0]!r}: choose from {', '.join(PEERS)}, or "
            f"several as gloo,mpi")
    return list(dict.fromkeys(names))


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``ddl-bench`` argument parser."""
    parser = _Parser(
        prog="ddl-bench",
        description="Latency, bandwidth and correctness of ddl's collectives, in the style\n"
                    "of nccl-tests. Run it under ddlrun: ddlrun -np N ddl-bench [options]",
        epilog=SIZE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", type=parse_ops, default=list(OPS), metavar="OPS",
                        help=f"comma-separated collectives, or all (default): "
                             f"{', '.join(OPS)}")
    sizes = parser.add_argument_group("sizes (give --sizes, or a range)")
    sizes.add_argument("--sizes", type=parse_size_list, metavar="LIST",
                       help="comma-separated sizes in bytes, K/M/G suffixes allowed "
                            "(powers of 1024), e.g. 4,64K,1M,16M")
    sizes.add_argument("-b", "--min-bytes", type=parse_size, metavar="SIZE",
                       help="smallest size of the range (default 4)")
    sizes.add_argument("-e", "--max-bytes", type=parse_size, metavar="SIZE",
                       help="largest size of the range (default 16M)")
    sizes.add_argument("-f", "--step-factor", type=_int_at_least(2), metavar="F",
                       help="multiply the size by F from one row to the next (default 4)")
    parser.add_argument("-d", "--dtype", choices=list(DTYPES), default="float32",
                        metavar="DTYPE", help=f"element type: {', '.join(DTYPES)} "
                                              f"(default float32)")
    parser.add_argument("-o", "--reduce-op", choices=list(REDUCE_OPS), default="sum",
                        help="the reduction of allreduce and reducescatter, as nccl-tests' "
                             "-o (default sum)")
    parser.add_argument("-n", "--iters", type=_int_at_least(1), default=None,
                        help=f"timed calls per case (default {SMALL_ITERS} up to "
                             f"{SMALL_CASE_BYTES // 1024} KiB, {LARGE_ITERS} above)")
    parser.add_argument("-w", "--warmup", type=_int_at_least(0), default=None,
                        help=f"untimed calls before them (default {SMALL_WARMUP} up to "
                             f"{SMALL_CASE_BYTES // 1024} KiB, {LARGE_WARMUP} above)")
    parser.add_argument("--timing", choices=["loop", "per-call"], default="loop",
                        help="loop (default, as nccl-tests): the mean time of --iters calls "
                             "made back to back, slowest rank; per-call: each call timed "
                             "and checked, the median of the slowest rank per call")
    parser.add_argument("--compare", type=parse_peers, default=[], metavar="PEERS",
                        help="also run gloo (torch.distributed with the Gloo backend; needs "
                             "torch), mpi (mpi4py; needs a job started by ddlrun --mpi or "
                             "mpiexec), nccl (torch.distributed with the NCCL backend; needs "
                             "--device cuda and a GPU per rank) or several (gloo,mpi) on the "
                             "same buffers, and add each one's time, check and PEER/ddl time "
                             "ratio (> 1: ddl is faster)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the inputs live: cpu (NumPy arrays) or cuda (CuPy arrays "
                             "on GPU local_rank %% device_count; Gloo and NCCL get torch CUDA "
                             "tensors)")
    parser.add_argument("--floor", action="store_true",
                        help="add a physical floor per row and ddl's time / floor: above "
                             "64 KiB the copy floor (every rank copies SIZE bytes once, all "
                             "at once), up to it a shared-memory ping-pong between ranks 0 "
                             "and 1")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV instead of the table")
    fmt.add_argument("--json", action="store_true",
                     help="print JSON (a list of row objects) instead of the table")
    parser.add_argument("--output", metavar="PATH",
                        help="write the table, CSV or JSON to PATH (rank 0) instead of "
                             "stdout")
    return parser


def size_range(low: int, high: int, factor: int) -> List[int]:
    """``low, low*factor, ...`` up to ``high`` inclusive, like nccl-tests' -b/-e/-f."""
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line; exits with status 2 and a message on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    ranged = (args.min_bytes, args.max_bytes, args.step_factor)
    if args.sizes is not None and any(v is not None for v in ranged):
        parser.error("give either --sizes or --min-bytes/--max-bytes/--step-factor, not both")
    if args.sizes is None:
        low = 4 if args.min_bytes is None else args.min_bytes
        high = 16 * 2 ** 20 if args.max_bytes is None else args.max_bytes
        if low > high:
            parser.error(f"--min-bytes ({low}) is larger than --max-bytes ({high})")
        args.sizes = size_range(low, high, args.step_factor or 4)
    for name in ("gloo", "nccl"):
        if name in args.compare:
            try:
                import torch.distributed  # noqa: F401
            except ImportError as exc:
                parser.error(f"--compare {name} needs PyTorch, which cannot be imported here "
                             f"({exc}); install it with: pip install torch")
    if "nccl" in args.compare and args.device != "cuda":
        parser.error("--compare nccl moves device memory: add --device cuda (and run a rank "
                     "per GPU)")
    if args.device == "cuda":
        _check_cuda(parser, args)
    if "mpi" in args.compare:
        _check_mpi(parser)
    return args


def _check_cuda(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a message unless CuPy sees a CUDA device and the options apply to it."""
    if args.floor:
        parser.error("--floor measures host memory; it does not apply to --device cuda")
    if "mpi" in args.compare:
        parser.error("--compare mpi moves host buffers; with --device cuda compare gloo or "
                     "nccl")
    if args.dtype == "bfloat16":
        parser.error("--device cuda makes CuPy arrays, and CuPy has no bfloat16")
    try:
        import cupy
    except ImportError as exc:
        parser.error(f"--device cuda makes CuPy arrays (the core collectives take them with "
                     f"no client) and needs CuPy, which cannot be imported here ({exc}); "
                     f"install it with: pip install cupy-cuda12x (or the wheel for your CUDA)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises its own CUDA runtime error without a driver
        parser.error(f"--device cuda: CuPy finds no CUDA device here ({exc})")
    if count == 0:
        parser.error("--device cuda: CuPy finds no CUDA device here")
    if "nccl" in args.compare:
        import torch
        import torch.distributed as dist
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            parser.error(f"--compare nccl needs PyTorch built with CUDA and NCCL; this torch "
                         f"{torch.__version__} has CUDA {torch.cuda.is_available()}, NCCL "
                         f"{dist.is_nccl_available()}")


def _check_mpi(parser: argparse.ArgumentParser) -> None:
    """Exit with a message unless mpi4py imports and MPI started this job (before
    ``ddl.init()``; importing ``mpi4py`` alone does not start MPI)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        parser.error(f"--compare mpi needs mpi4py, which cannot be imported here ({exc}); "
                     f"install it with: pip install mpi4py (built against your MPI, or "
                     f"pip install mpich mpi4py)")
    try:
        launcher = _mpi.detect()
    except ConfigError as exc:
        parser.error(f"--compare mpi: {exc}")
    if launcher is None:
        parser.error("--compare mpi needs an MPI world, and this job was not started by MPI "
                     "(plain ddlrun starts none): run ddlrun --mpi -np N ddl-bench ... or "
                     "mpiexec -n N ddl-bench ...")


# -- cases: layout, inputs and expected results --------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One (op, size, dtype) measured on ``n`` ranks, seen from ``rank``."""

    op: str
    nbytes: int      # the size actually used (see SIZE_HELP)
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


# -- timing ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    """How one implementation runs a case: ``call()`` makes one collective and returns
    its result; ``reset()`` (untimed, before each call) restores in-place buffers."""

    call: Callable[[], Any]
    reset: Callable[[], None] = lambda: None
    sync: Callable[[], None] = lambda: None  # waits for the device (timed, after a loop)


@dataclasses.dataclass
class Timing:
    """A block's result, over all ranks: median and min per-call time (slowest rank per
    call), and how many calls on any rank returned a wrong result."""

    median_s: float
    min_s: float
    wrong: int


def time_block(runner: Runner, expected: np.ndarray, iters: int, warmup: int,
               timing: str = "loop") -> Tuple[np.ndarray, int]:
    """Run ``warmup`` checked calls, a barrier, then ``iters`` timed calls; return this
    rank's times in seconds and its count of wrong results.

    ``timing="loop"`` (nccl-tests' way) times the ``iters`` calls back to back, after one
    untimed call that lines the ranks up, and returns one time, their mean; one more call
    after the loop is checked (untimed, after a ``reset``). ``"per-call"`` times and
    checks each call, with a ``reset`` before each.
    """
    wrong = 0
    for _ in range(warmup):
        runner.reset()
        wrong += not same(runner.call(), expected)
    ddl.barrier()
    if timing == "loop":
        call = runner.call
        runner.reset()
        call()  # lines the ranks up (leaving the barrier, they can be far apart)
        runner.sync()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        runner.sync()
        elapsed = time.perf_counter() - start
        runner.reset()
        wrong += not same(runner.call(), expected)
        return np.array([elapsed / iters]), wrong
    times = np.empty(iters)
    for i in range(iters):
        runner.reset()
        runner.sync()
        start = time.perf_counter()
        result = runner.call()
        runner.sync()
        times[i] = time.perf_counter() - start
        wrong += not same(result, expected)
    return times, wrong


def gather_timing(times: np.ndarray, wrong: int, name: str) -> Timing:
    """Combine every rank's times and wrong counts (one ddl allgather, untimed): per call
    the slowest rank; the median and minimum over the calls. One time per rank (loop
    timing): the slowest rank's, and the fastest rank's as the minimum."""
    mine = np.append(times, float(wrong))[None, :]
    every = ddl.allgather(mine, name=name)
    slowest = every[:, :-1].max(axis=0)
    fastest = every[:, 0].min() if len(times) == 1 else slowest.min()
    return Timing(float(np.median(slowest)), float(fastest), int(every[:, -1].sum()))


def ddl_runner(case: Case, x: Any) -> Runner:
    """The ddl call of ``case`` on input ``x`` (ddl never changes its input)."""
    name = case.name
    op = {"sum": ddl.Sum, "prod": ddl.Product, "min": ddl.Min, "max": ddl.Max}[case.reduce_op]
    calls = {
        "allreduce": lambda: ddl.allreduce(x, name=name, op=op),
        "allgather": lambda: ddl.allgather(x, name=name),
        "broadcast": lambda: ddl.broadcast(x, root_rank=0, name=name),
        "alltoall": lambda: ddl.alltoall(x, name=name)[0],
        "reducescatter": lambda: ddl.reducescatter(x, name=name, op=op),
    }
    return Runner(calls[case.op], sync=device_sync(x))


# -- devices --------------------------------------------------------------------------------

def to_torch(array: np.ndarray, device: Any = None):
    """A torch tensor of ``array`` (a view on the CPU; bfloat16 through an int16 view),
    moved to ``device`` when one is given."""
    import torch
    if array.dtype == BFLOAT16:
        t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t if device is None else t.to(device)


def host_view(result: Any) -> np.ndarray:
    """``result`` as a host NumPy array: a torch tensor (on any device) or a CuPy array is
    copied back."""
    module = type(result).__module__
    if module.startswith("cupy"):
        return sys.modules["cupy"].asnumpy(result)
    if module.startswith("torch"):
        import torch
        t = result.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()
    return np.asarray(result)


def input_device(args: argparse.Namespace) -> Optional[int]:
    """The CUDA device this rank's inputs live on (``local_rank % device_count``), or None
    for host NumPy arrays."""
    if args.device == "cpu":
        return None
    import cupy
    return ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()


def to_cupy(array: np.ndarray, device: int):
    """A CuPy array of ``array`` on CUDA device ``device``."""
    import cupy
    with cupy.cuda.Device(device):
        return cupy.asarray(array)


def device_sync(x: Any) -> Callable[[], None]:
    """What waits for the device ``x`` is on (nothing for host arrays): a CuPy array's or
    a CUDA tensor's."""
    if type(x).__module__.startswith("cupy"):
        device = x.device
        return device.synchronize
    if getattr(x, "is_cuda", False):
        import torch
        return lambda: torch.cuda.synchronize(x.device)
    return lambda: None


# -- torch.distributed: Gloo, NCCL ----------------------------------------------------------

class TorchDist:
    """torch.distributed with ``backend`` (``"gloo"`` or ``"nccl"``), in this process, on
    the ddl job's ranks: the first one started makes the default process group (at
    :func:`_torch_rendezvous`), a later one a group of its own. NCCL takes the GPU the
    inputs are on and refuses two ranks on one GPU: then the constructor raises
    CompareError on every rank."""

    def __init__(self, backend: str) -> None:
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.name = torch, dist, backend
        self.dtypes = GLOO_DTYPES if backend == "gloo" else NCCL_DTYPES
        if backend == "nccl":
            device = ddl.local_rank() % torch.cuda.device_count()
            _one_rank_per_gpu(device)
            torch.cuda.set_device(device)
        if ddl.local_size() != ddl.size():
            _pin_interface()
        self.group = None   # the default group
        if dist.is_initialized():
            self.group = dist.new_group(backend=backend)
        else:
            dist.init_process_group(backend, init_method=_torch_rendezvous(),
                                    rank=ddl.rank(), world_size=ddl.size(),
                                    timeout=datetime.timedelta(seconds=300))
        # Newer torch names them *_single; older torch has only the *_tensor names.
        self._all_gather = getattr(dist, "all_gather_single", None) or \
            dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or \
            dist.reduce_scatter_tensor

    def close(self) -> None:
        self.dist.destroy_process_group(self.group)

    def describe(self) -> str:
        version = ""
        if self.name == "nccl":   # (a tuple; an int from older torch)
            found = self.torch.cuda.nccl.version()
            version = ", NCCL " + (".".join(map(str, found)) if isinstance(found, tuple)
                                   else str(found))
        return (f"torch.distributed {'Gloo' if self.name == 'gloo' else 'NCCL'} (torch "
                f"{self.torch.__version__}{version}), in place")

    def runner(self, case: Case, x: np.ndarray, expected: np.ndarray,
               device: Any = None) -> Runner:
        """The torch op of ``case`` on tensors of ``x`` (on ``device``, else views of the
        host arrays): reads ``x``, writes an output shaped like ``expected``, which
        ``reset`` fills with values that differ from it everywhere, so a call that writes
        nothing is caught."""
        dist, op, group = self.dist, case.op, self.group
        red = getattr(dist.ReduceOp, _TORCH_REDUCE_OPS[case.reduce_op])
        if op in ("allreduce", "broadcast"):  # in place: reset the buffer to the input
            source = to_torch(x, device)
            t = source.clone()
            call = (lambda: dist.all_reduce(t, op=red, group=group)) if op == "allreduce" \
                else (lambda: dist.broadcast(t, src=0, group=group))
            return Runner(lambda: (call(), t)[1], lambda: t.copy_(source), device_sync(t))
        poison = to_torch((expected == 0).astype(case.dtype), device)
        t_in, t_out = to_torch(x, device), poison.clone()
        calls = {
            "allgather": lambda: self._all_gather(t_out, t_in, group=group),
            "alltoall": lambda: dist.all_to_all_single(t_out, t_in, group=group),
            "reducescatter": lambda: self._reduce_scatter(t_out, t_in, op=red, group=group),
        }
        call = calls[op]
        return Runner(lambda: (call(), t_out)[1], lambda: t_out.copy_(poison),
                      device_sync(t_out))


def _one_rank_per_gpu(device: int) -> None:
    """CompareError on every rank when two ranks of the job are on one GPU (NCCL refuses
    them: ``ncclInvalidUsage``, duplicate GPU), naming both ranks and the GPU."""
    from ddl.runtime import device_arrays as cuda
    uuid = cuda.device_info(device)[0].encode()[:64].ljust(64)
    got = ddl.allgather(np.frombuffer(uuid, np.uint8).reshape(1, 64),
                        name="ddl-bench/nccl-gpus")
    first: Dict[bytes, int] = {}
    for rank, row in enumerate(np.asarray(got).reshape(ddl.size(), 64)):
        key = bytes(row)
        if key in first:
            raise CompareError(
                f"--compare nccl: ranks {first[key]} and {rank} are on the same GPU "
                f"({key.decode().strip()}), and NCCL refuses two ranks on one GPU; run "
                f"one rank per GPU (-np at most the GPUs), or compare with gloo")
        first[key] = rank


def _torch_rendezvous() -> str:
    """torch.distributed's ``tcp://`` rendezvous, the same on every rank: a free port of
    rank 0's on 127.0.0.1 where the job is on one host, else on the address its data
    plane listens on, which the other hosts reach (rank 0 broadcasts it with ddl)."""
    raw = np.zeros(256, np.uint8)
    if ddl.rank() == 0:
        host = "127.0.0.1"
        if ddl.local_size() != ddl.size():
            host = _data_plane_host(0)
            try:
                socket.getaddrinfo(host or None, 0)
            except OSError:
                host = ""
            host = host or socket.gethostbyname(socket.gethostname())
        text = f"[{host}]" if ":" in host else host
        text = f"tcp://{text}:{_free_port(host)}".encode()
        raw[:len(text)] = np.frombuffer(text, np.uint8)
    got = ddl.broadcast(raw, root_rank=0, name="ddl-bench/torch-rendezvous")
    return bytes(np.asarray(got)).rstrip(b"\0").decode()


def _data_plane_host(rank: int) -> str:
    """The address ``rank``'s data plane listens on (the one other hosts reach), or ""."""
    from ddl.runtime import runtime as _runtime
    try:
        return _runtime.runtime().transport.address_of(rank).rpartition(":")[0].strip("[]")
    except AttributeError:   # (a transport without addresses)
        return ""


def _pin_interface() -> None:
    """A job on several hosts: Gloo's and NCCL's sockets on the interface of this rank's
    data plane (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless set), not the one
    the host name resolves to, which may be loopback."""
    from ddl.launcher._probe import interface_of
    name = interface_of(_data_plane_host(ddl.rank()))
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def _free_port(host: str) -> int:
    """A TCP port on ``host`` (an address of this machine) that is free now."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# -- MPI ------------------------------------------------------------------------------------

class CompareError(RuntimeError):
    """A --compare implementation cannot run in this job (the same on every rank)."""


class Mpi:
    """mpi4py on a duplicate of ``MPI.COMM_WORLD``, whose ranks must be the ddl job's in
    the same order (true when MPI started the job and ddl-bench called ``ddl.init()``).
    Raises CompareError on every rank when they are not."""

    name = "mpi"
    dtypes = MPI_DTYPES

    def __init__(self) -> None:
        self.MPI = MPI = _mpi.import_mpi()
        world = MPI.COMM_WORLD
        size, rank = world.Get_size(), world.Get_rank()
        mismatch = np.array([int(size != ddl.size() or rank != ddl.rank())], np.int64)
        if ddl.allreduce(mismatch, op=ddl.Sum, name="ddl-bench/mpi-world")[0]:
            raise CompareError(
                f"--compare mpi: MPI.COMM_WORLD has {size} ranks (this is rank {rank}) and "
                f"the ddl job {ddl.size()} (rank {ddl.rank()}); start ddl-bench itself "
                f"under MPI (ddlrun --mpi -np N ddl-bench ... or mpiexec -n N ddl-bench ...) "
                f"so that they are the same ranks")
        self.comm = world.Dup()

    def close(self) -> None:
        self.comm.Free()

    def describe(self) -> str:
        import mpi4py
        library = " ".join(self.MPI.Get_library_version().strip().splitlines()[0].split())
        return f"mpi4py {mpi4py.__version__} on {library}, MPI.COMM_WORLD, out of place"

    def runner(self, case: Case, x: np.ndarray, expected: np.ndarray) -> Runner:
        """The MPI op of ``case``: reads ``x``, writes an output array shaped like
        ``expected``, which ``reset`` fills with values that differ from it everywhere
        (broadcast, in place: with this rank's input)."""
        comm, red = self.comm, getattr(self.MPI, _MPI_REDUCE_OPS[case.reduce_op])
        out = np.empty_like(expected)
        if case.op == "broadcast":
            return Runner(lambda: (comm.Bcast(out, root=0), out)[1],
                          lambda: np.copyto(out, x))
        calls = {
            "allreduce": lambda: comm.Allreduce(x, out, op=red),
            "allgather": lambda: comm.Allgather(x, out),
            "alltoall": lambda: comm.Alltoall(x, out),
            "reducescatter": lambda: comm.Reduce_scatter_block(x, out, op=red),
        }
        call = calls[case.op]
        poison = (expected == 0).astype(case.dtype)
        return Runner(lambda: (call(), out)[1], lambda: np.copyto(out, poison))


def start_peers(names: Sequence[str]) -> list:
    """The --compare implementations, started in order on every rank; those started
    before one that fails are closed again."""
    peers: list = []
    try:
        for name in names:
            peers.append(Mpi() if name == "mpi" else TorchDist(name))
    except BaseException:
        close_peers(peers)
        raise
    return peers


def close_peers(peers: Sequence[Any]) -> None:
    for peer in reversed(peers):
        peer.close()


# -- the copy floor ---------------------------------------------------------------------------

def copy_floor(case: Case, iters: int, warmup: int) -> Timing:
    """The copy floor of ``case``: every rank copies ``case.nbytes`` bytes once with
    ``np.copyto``, all ranks after one barrier per copy; per copy the slowest rank, and
    the median over ``iters`` copies (after ``warmup`` + 1 untimed ones, which also fault
    the pages in). Every rank calls it for the same case."""
    src = np.ones(case.nbytes, np.uint8)
    dst = np.empty_like(src)
    for _ in range(warmup + 1):
        np.copyto(dst, src)
    times = np.empty(iters)
    for i in range(iters):
        ddl.barrier()
        start = time.perf_counter()
        np.copyto(dst, src)
        times[i] = time.perf_counter() - start
    return gather_timing(times, 0, f"{case.name}/stats/floor")


def pingpong_floor(case: Case, iters: int, warmup: int) -> Optional[Timing]:
    """The ping-pong floor of ``case``: ranks 0 and 1 bounce a message of ``case.nbytes``
    bytes through one shared-memory segment (a memfd of rank 0's, which rank 1 opens
    through /proc, so nothing is left behind), each copying it in, raising its flag,
    spinning in Python on the other's flag and copying it out: half the median round trip
    over ``iters`` round trips (after ``warmup`` + 1), the slower of the two ranks. The
    other ranks wait. None on every rank when the job has one rank, its ranks are not
    all on one host, or rank 1 cannot open the segment. Every rank calls it for the same
    case."""
    if ddl.size() < 2 or ddl.local_size() != ddl.size():
        return None
    rank, size = ddl.rank(), 2 * _LINE + 2 * case.nbytes
    fd, failed, segment = -1, 0, None
    if rank == 0:
        fd = os.memfd_create("ddl-bench-pingpong")
        os.ftruncate(fd, size)
    where = np.array([os.getpid(), fd], np.int64)
    where = ddl.broadcast(where, root_rank=0, name="ddl-bench/pingpong/segment")
    try:
        if rank == 1:
            try:
                fd = os.open(f"/proc/{where[0]}/fd/{where[1]}", os.O_RDWR)
            except OSError:
                failed = 1
        if fd >= 0:
            segment = mmap.mmap(fd, size)
        # also keeps rank 0's descriptor open until rank 1 has opened the segment
        failed = int(ddl.allreduce(np.array([failed], np.int64), op=ddl.Sum,
                                   name="ddl-bench/pingpong/opened")[0])
    finally:
        if fd >= 0:
            os.close(fd)  # the mapping keeps the memory
    try:
        if failed:
            return None
        half = _bounce(segment, case.nbytes, rank, iters, warmup) if rank < 2 else 0.0
        return gather_timing(np.array([half]), 0, f"{case.name}/stats/pingpong")
    finally:
        if segment is not None:
            segment.close()


def _bounce(segment: mmap.mmap, nbytes: int, rank: int, iters: int, warmup: int) -> float:
    """Rank 0's or rank 1's side of :func:`pingpong_floor`: half the median round trip in
    seconds. DDLTimeoutError when the other rank does not answer within
    PINGPONG_TIMEOUT_S."""
    flags = np.frombuffer(segment, np.int64, count=2 * _LINE // 8)
    mine, theirs = (0, _LINE // 8) if rank == 0 else (_LINE // 8, 0)
    slot_in, slot_out = (np.frombuffer(segment, np.uint8, nbytes, 2 * _LINE + k * nbytes)
                         for k in ((1, 0) if rank == 0 else (0, 1)))
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    deadline = time.monotonic() + PINGPONG_TIMEOUT_S

    def wait(seq: int) -> None:
        spins = 0
        while flags[theirs] != seq:
            spins += 1
            if spins % 256 == 0:  # let the other rank run if it shares our core
                os.sched_yield()
                if time.monotonic() > deadline:
                    raise DDLTimeoutError(
                        f"ddl-bench --floor: rank {1 - rank} did not answer the ping-pong "
                        f"within {PINGPONG_TIMEOUT_S:g} s", op="ddl-bench",
                        timeout=PINGPONG_TIMEOUT_S, rank=1 - rank, cause="ping-pong")

    def round_trip(seq: int) -> None:
        if rank == 0:
            np.copyto(slot_out, src)
            flags[mine] = seq
            wait(seq)
            np.copyto(dst, slot_in)
        else:
            wait(seq)
            np.copyto(dst, slot_in)
            np.copyto(slot_out, src)
            flags[mine] = seq

    for seq in range(1, warmup + 2):
        round_trip(seq)
    times = np.empty(iters)
    for i, seq in enumerate(range(warmup + 2, warmup + 2 + iters)):
        start = time.perf_counter()
        round_trip(seq)
        times[i] = time.perf_counter() - start
    return float(np.median(times)) / 2


# -- rows -----------------------------------------------------------------------------------

def _check(timing: Timing) -> str:
    return "ok" if timing.wrong == 0 else "WRONG"


def make_row(case: Case, ddl_timing: Timing, peers: Dict[str, Optional[Timing]],
             floor: Optional[Tuple[str, Optional[Timing]]] = None) -> Dict[str, Any]:
    """One output row: ddl's fields, then for each implementation of ``peers`` (name ->
    its timing, None where it can't run the dtype) its PEER_* fields, then with ``floor``
    (its kind, and its timing or None where it could not be measured) the floor_*
    fields."""
    factor = busbw_factor(case.op, case.n)
    algbw = case.nbytes / ddl_timing.median_s / 1e9
    row: Dict[str, Any] = {
        "op": case.op, "size": case.nbytes, "count": case.count, "dtype": case.dtype_name,
        "redop": case.reduce_op if case.op in REDUCING_OPS else None, "ranks": case.n, "time_us": ddl_timing.median_s * 1e6,
        "min_us": ddl_timing.min_s * 1e6, "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor, "check": _check(ddl_timing),
    }
    for name, g in peers.items():
        peer_algbw = case.nbytes / g.median_s / 1e9 if g else None
        row.update({
            f"{name}_time_us": g.median_s * 1e6 if g else None,
            f"{name}_min_us": g.min_s * 1e6 if g else None,
            f"{name}_algbw_gbps": peer_algbw,
            f"{name}_busbw_gbps": peer_algbw * factor if g else None,
            f"{name}_check": _check(g) if g else "n/a",
            f"{name}_ratio": g.median_s / ddl_timing.median_s if g else None,
        })
    if floor is not None:
        kind, f = floor
        row.update({"floor_kind": kind if f else None,
                    "floor_us": f.median_s * 1e6 if f else None,
                    "floor_ratio": ddl_timing.median_s / f.median_s if f else None})
    return row


def calls_per_case(case: Case, args: argparse.Namespace) -> Tuple[int, int]:
    """(timed calls, warm-up calls) of ``case``: ``--iters`` and ``--warmup``, or by default
    many for small cases (as OSU's benchmarks do: a short block is dominated by how the
    ranks settle into step, especially with more ranks than cores), few for large ones."""
    small = case.nbytes <= SMALL_CASE_BYTES
    iters = args.iters if args.iters is not None else (SMALL_ITERS if small else LARGE_ITERS)
    warmup = args.warmup if args.warmup is not None else (
        SMALL_WARMUP if small else LARGE_WARMUP)
    return iters, warmup


def run_case(case: Case, args: argparse.Namespace, peers: Sequence[Any]) -> Dict[str, Any]:
    """Measure and check ``case`` with ddl, then with each of ``peers`` that supports its
    dtype, then (``--floor``) the copy floor; return its row."""
    x = make_input(case)
    expected = expected_output(case)
    iters, warmup = calls_per_case(case, args)
    device = input_device(args)
    x_in = x if device is None else to_cupy(x, device)
    times, wrong = time_block(ddl_runner(case, x_in), expected, iters, warmup, args.timing)
    ddl_timing = gather_timing(times, wrong, f"{case.name}/stats/ddl")
    peer_timings: Dict[str, Optional[Timing]] = {}
    for peer in peers:
        peer_timings[peer.name] = None
        if case.dtype_name in peer.dtypes:
            runner = (peer.runner(case, x, expected) if device is None else
                      peer.runner(case, x, expected, f"cuda:{device}"))
            times, wrong = time_block(runner, expected, iters, warmup, args.timing)
            peer_timings[peer.name] = gather_timing(times, wrong,
                                                    f"{case.name}/stats/{peer.name}")
    floor: Optional[Tuple[str, Optional[Timing]]] = None
    if args.floor:
        floor = ("copy", copy_floor(case, iters, warmup)) if case.nbytes > FLOOR_MIN_BYTES \
            else ("pingpong", pingpong_floor(case, iters, warmup))
    return make_row(case, ddl_timing, peer_timings, floor)


def is_wrong(row: Dict[str, Any]) -> bool:
    """Whether any implementation returned a wrong result in ``row``."""
    return any(row.get(field) == "WRONG"
               for field in ["check"] + [f"{name}_check" for name in PEERS])


# -- output ---------------------------------------------------------------------------------

_TABLE_COLUMNS = [  # (header, field, alignment and width, format)
    ("op", "op", "<13", "s"), ("size(B)", "size", ">12", "d"),
    ("count", "count", ">11", "d"), ("dtype", "dtype", ">8", "s"),
    ("time(us)", "time_us", ">10", ".1f"), ("algbw(GB/s)", "algbw_gbps", ">11", ".3f"),
    ("busbw(GB/s)", "busbw_gbps", ">11", ".3f"), ("check", "check", ">5", "s"),
]
_FLOOR_COLUMNS = [("floor", "floor_kind", ">8", "s"), ("floor(us)", "floor_us", ">10", ".1f"),
                  ("ddl/floor", "floor_ratio", ">9", ".2f")]


def _peer_columns(name: str) -> List[Tuple[str, str, str, str]]:
    """The table columns of one --compare implementation."""
    return [(f"{name}(us)", f"{name}_time_us", ">10", ".1f"),
            (f"{name}_check", f"{name}_check", ">10", "s"),
            (f"{name}/ddl", f"{name}_ratio", ">8", ".2f")]


def _cell(value: Any, width: str, fmt: str) -> str:
    """One table cell; a missing value (a peer can't run this dtype) reads ``n/a``."""
    if value is None:
        return f"{'n/a':{width}}"
    return f"{value:{width}{fmt}}"


class Report:
    """Rank 0's output: a table streamed row by row, or CSV/JSON written at the end."""

    def __init__(self, args: argparse.Namespace, n: int, out: TextIO,
                 peers: Sequence[Any] = ()) -> None:
        self.args, self.n, self.out, self.peers = args, n, out, peers
        self.columns = list(_TABLE_COLUMNS)
        for peer in peers:
            self.columns += _peer_columns(peer.name)
        if args.floor:
            self.columns += _FLOOR_COLUMNS
        self.table = not (args.csv or args.json)

    def start(self) -> None:
        if not self.table:
            return
        a = self.args
        factors = ", ".join(f"{op} {busbw_factor(op, self.n):.3g}" for op in a.op)
        def rule(given: Optional[int], small: int, large: int) -> str:
            return str(given) if given is not None else (
                f"{small} up to {SMALL_CASE_BYTES // 1024} KiB ({large} above)")
        calls = (f"{rule(a.warmup, SMALL_WARMUP, LARGE_WARMUP)} warm-up + "
                 f"{rule(a.iters, SMALL_ITERS, LARGE_ITERS)} timed calls")
        self._line(f"# ddl-bench: {self.n} rank{'s' * (self.n != 1)}, {a.dtype}; per row "
                   f"{calls}; {a.reduce_op.capitalize()} reductions, broadcast root 0")
        self._line("# time(us): mean over the timed calls made back to back, slowest rank, "
                   "in microseconds" if a.timing == "loop" else
                   "# time(us): median over the calls of the slowest rank's time per call, "
                   "in microseconds")
        self._line(f"# algbw = size / time; busbw = algbw * factor ({factors})")
        if a.device == "cuda":
            self._line("# inputs: CuPy arrays on GPU local_rank % device_count (Gloo and "
                       "NCCL: torch CUDA tensors there); each timed block ends when the GPU "
                       "has finished")
        for peer in self.peers:
            self._line(f"# {peer.name}: {peer.describe()}, on the same input; "
                       f"{peer.name}/ddl > 1 means ddl is faster")
            if a.dtype not in peer.dtypes:
                self._line(f"# {peer.name}: n/a, it does not support {a.dtype}")
        if a.floor:
            self._line(f"# floor(us): above {FLOOR_MIN_BYTES // 1024} KiB the copy floor, "
                       f"every rank copies size bytes once (np.copyto), all at once after "
                       f"a barrier (slowest rank, median over the copies); up to it the "
                       f"pingpong floor, half the median round trip of size bytes "
                       f"between ranks 0 and 1 through shared memory (Python spinning on a flag); "
                       f"ddl/floor = time / floor")
        self._line("#")
        self._line(" ".join(f"{h:{w}}" for h, _, w, _ in self.columns))

    def row(self, row: Dict[str, Any]) -> None:
        if self.table:
            self._line(" ".join(_cell(row[f], w, fmt) for _, f, w, fmt in self.columns))

    def finish(self, rows: List[Dict[str, Any]]) -> None:
        if self.args.csv:
            self.out.write(format_csv(rows))
        elif self.args.json:
            self.out.write(format_json(rows))
        else:
            wrong = sum(is_wrong(r) for r in rows)
            self._line(f"# {len(rows)} rows, " + (
                "every result correct" if not wrong else f"{wrong} with WRONG results"))
        self.out.flush()

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def format_csv(rows: List[Dict[str, Any]]) -> str:
    """``rows`` as CSV with a header line; a missing value is an empty field."""
    if not rows:
        return ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def format_json(rows: List[Dict[str, Any]]) -> str:
    """``rows`` as a JSON list of objects, one row per line; a missing value is null."""
    return "[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n"


# -- main -----------------------------------------------------------------------------------

def op_cases(op: str, sizes: Sequence[int], dtype_name: str,
             reduce_op: str = "sum") -> List[Case]:
    """This rank's cases of ``op``, in the order of ``sizes``; requested sizes that round
    to the same size make one case."""
    cases: Dict[int, Case] = {}
    for size in sizes:
        case = make_case(op, size, dtype_name, ddl.rank(), ddl.size(), reduce_op)
        cases.setdefault(case.nbytes, case)
    return list(cases.values())


def run_all(args: argparse.Namespace, report: Optional[Report],
            peers: Sequence[Any]) -> List[Dict[str, Any]]:
    """Every case, op by op and size by size; rows go to ``report`` (rank 0's) as made."""
    rows = []
    for op in args.op:
        for case in op_cases(op, args.sizes, args.dtype, args.reduce_op):
            row = run_case(case, args, peers)
            rows.append(row)
            if report is not None:
                report.row(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark on every rank of the job: 0 if every result was correct, 1 if
    any was wrong, 2 on bad arguments (after a message on rank 0)."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    owns_ddl = not ddl.is_initialized()
    ddl.init()
    try:
        return _run(args)
    finally:
        if owns_ddl:
            ddl.shutdown()


def _run(args: argparse.Namespace) -> int:
    """The benchmark of ``main`` once ddl is up: output file (rank 0), the --compare
    implementations, every case."""
    out = None
    if ddl.rank() == 0:
        try:
            out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        except OSError as exc:
            print(f"ddl-bench: error: cannot write --output {args.output}: {exc.strerror}",
                  file=sys.stderr)
            return 2
    peers: list = []
    try:
        try:
            peers = start_peers(args.compare)
        except CompareError as exc:
            if out is not None:
                print(f"ddl-bench: error: {exc}", file=sys.stderr)
            return 2
        report = Report(args, ddl.size(), out, peers) if out is not None else None
        if report is not None:
            report.start()
        rows = run_all(args, report, peers)
        if report is not None:
            report.finish(rows)
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
        close_peers(peers)
    return 1 if any(is_wrong(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
