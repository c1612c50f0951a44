"""ddl-bench: latency, bandwidth and correctness of every ddl collective, nccl-tests style.

    ddlrun -np 2 ddl-bench --op all --sizes 4,1M,16M [--compare gloo] [--csv|--json]

Every rank runs the same cases, one collective per (op, size); rank 0 prints one row per
case. Each case runs ``--warmup`` untimed calls, then a barrier, then ``--iters`` timed
calls. By default (``--timing loop``, as nccl-tests) the timed calls run back to back and
a rank's time is their mean; the row shows the slowest rank's (CSV and JSON also give the
fastest rank's). With ``--timing per-call`` each call is timed alone: a call's time is the
slowest rank's time for that call, and the row shows the median over the calls (CSV and
JSON also give the minimum). Results are compared with the exactly known expected value
(every warm-up call, then every timed call or, in loop timing, one more call after the
loop): inputs are small integers, ``(i + 7 * rank) mod p`` at element ``i`` for a prime
``p`` small enough that every sum is exact in the dtype, so a single wrong element makes
the row ``WRONG`` and the exit status 1.

With ``--compare gloo`` torch.distributed is started with the Gloo backend in the same
processes (rank 0 picks a free port on 127.0.0.1 and broadcasts it with ddl), and each
case is run and checked again with the equivalent torch op on ``torch.from_numpy`` views
of the same buffers, right after ddl's block.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import os
import re
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import numpy as np

import ddl
from ddl.core.dtypes import BFLOAT16

OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
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
# calls per case by default: many for small cases, few for large ones
SMALL_CASE_BYTES = 64 * 1024
SMALL_ITERS, SMALL_WARMUP = 1000, 100
LARGE_ITERS, LARGE_WARMUP = 20, 5
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
Reductions use Sum; broadcast's root is rank 0.

output: a table on rank 0's stdout (rows appear as they are measured), or CSV (--csv)
or JSON (--json: a list of row objects with the CSV's fields); --output PATH writes it
to PATH instead of stdout. Exit status: 0 if every result was correct, 1 if any was
WRONG, 2 for bad arguments.

example:
  ddlrun -np 2 ddl-bench --op all --sizes 4,1M,16M --compare gloo
"""


# -- command line --------------------------------------------------------------------------

def _is_rank0() -> bool:
    """Whether this process is rank 0 (or not under a launcher), before ``ddl.init()``."""
    return os.environ.get("DDL_RANK", "0") == "0"


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
    parser.add_argument("--compare", choices=["gloo"],
                        help="also run torch.distributed with the Gloo backend on the same "
                             "buffers, and add its time, check and gloo/ddl time ratio "
                             "(> 1: ddl is faster); needs torch")
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
    if args.compare == "gloo":
        try:
            import torch.distributed  # noqa: F401
        except ImportError as exc:
            parser.error(f"--compare gloo needs PyTorch, which cannot be imported here "
                         f"({exc}); install it with: pip install torch")
    return args


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
        return f"ddl-bench/{self.op}/{self.dtype_name}/{self.nbytes}"


def make_case(op: str, requested: int, dtype_name: str, rank: int, n: int) -> Case:
    """The case for a requested size, rounded down to whole elements (or n-blocks)."""
    itemsize = DTYPES[dtype_name].itemsize
    unit = n if op in BLOCKED_OPS else 1
    count = max(unit, requested // itemsize // unit * unit)
    return Case(op, count * itemsize, count, dtype_name, rank, n)


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def pattern_modulus(dtype_name: str, n: int) -> int:
    """Largest prime of ``_PRIMES`` whose n-rank sums of residues stay exact in the dtype."""
    dtype = DTYPES[dtype_name]
    limit = _EXACT_LIMIT.get(dtype_name) or int(np.iinfo(dtype).max)
    for prime in _PRIMES:
        if (prime - 1) * n <= limit:
            return prime
    return 1


def pattern(rank: int, count: int, case: Case) -> np.ndarray:
    """Rank ``rank``'s input values as int64: ``(i + 7 * rank) mod p``."""
    modulus = pattern_modulus(case.dtype_name, case.n)
    return (np.arange(count, dtype=np.int64) + _RANK_STRIDE * rank) % modulus


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
    if case.op == "allreduce":
        exact = sum(pattern(s, case.count, case) for s in ranks)
    elif case.op == "allgather":
        exact = np.concatenate([pattern(s, block, case) for s in ranks])
    elif case.op == "broadcast":
        exact = pattern(0, case.count, case)
    elif case.op == "alltoall":
        exact = np.concatenate([pattern(s, case.count, case)[r * block:(r + 1) * block]
                                for s in ranks])
    elif case.op == "reducescatter":
        exact = sum(pattern(s, case.count, case) for s in ranks)[r * block:(r + 1) * block]
    else:
        raise ValueError(f"unknown op {case.op!r}")
    return exact


def same(result: Any, expected: np.ndarray) -> bool:
    """Whether ``result`` has ``expected``'s dtype and shape and exactly its bytes."""
    result = np.asarray(result)
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
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = time.perf_counter() - start
        runner.reset()
        wrong += not same(runner.call(), expected)
        return np.array([elapsed / iters]), wrong
    times = np.empty(iters)
    for i in range(iters):
        runner.reset()
        start = time.perf_counter()
        result = runner.call()
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


def ddl_runner(case: Case, x: np.ndarray) -> Runner:
    """The ddl call of ``case`` on input ``x`` (ddl never changes its input)."""
    name = case.name
    calls = {
        "allreduce": lambda: ddl.allreduce(x, name=name, op=ddl.Sum),
        "allgather": lambda: ddl.allgather(x, name=name),
        "broadcast": lambda: ddl.broadcast(x, root_rank=0, name=name),
        "alltoall": lambda: ddl.alltoall(x, name=name)[0],
        "reducescatter": lambda: ddl.reducescatter(x, name=name, op=ddl.Sum),
    }
    return Runner(calls[case.op])


# -- Gloo -----------------------------------------------------------------------------------

class Gloo:
    """torch.distributed with the Gloo backend, in this process, on the ddl job's ranks."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        port = np.array([_free_port() if ddl.rank() == 0 else 0], dtype=np.int64)
        port = int(ddl.broadcast(port, root_rank=0, name="ddl-bench/gloo-port")[0])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=ddl.rank(), world_size=ddl.size(),
                                timeout=datetime.timedelta(seconds=300))
        # Newer torch names them *_single; older torch has only the *_tensor names.
        self._all_gather = getattr(dist, "all_gather_single", None) or \
            dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or \
            dist.reduce_scatter_tensor

    def close(self) -> None:
        self.dist.destroy_process_group()

    def tensor(self, array: np.ndarray):
        """A torch view of ``array`` (bfloat16 goes through an int16 view)."""
        if array.dtype == BFLOAT16:
            return self.torch.from_numpy(array.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(array)

    def runner(self, case: Case, x: np.ndarray, expected: np.ndarray) -> Runner:
        """The torch op of ``case``: reads ``x``, writes an output array shaped like
        ``expected``, which ``reset`` fills with values that differ from it everywhere,
        so a call that writes nothing is caught."""
        dist, op = self.dist, case.op
        if op in ("allreduce", "broadcast"):  # in place: reset the buffer to the input
            out = x.copy()
            t = self.tensor(out)
            call = (lambda: dist.all_reduce(t)) if op == "allreduce" else \
                (lambda: dist.broadcast(t, src=0))
            return Runner(lambda: (call(), out)[1], lambda: np.copyto(out, x))
        out = np.empty_like(expected)
        poison = (expected == 0).astype(case.dtype)
        t_in, t_out = self.tensor(x), self.tensor(out)
        calls = {
            "allgather": lambda: self._all_gather(t_out, t_in),
            "alltoall": lambda: dist.all_to_all_single(t_out, t_in),
            "reducescatter": lambda: self._reduce_scatter(t_out, t_in),
        }
        call = calls[op]
        return Runner(lambda: (call(), out)[1], lambda: np.copyto(out, poison))


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- rows -----------------------------------------------------------------------------------

def _check(timing: Timing) -> str:
    return "ok" if timing.wrong == 0 else "WRONG"


def make_row(case: Case, ddl_timing: Timing, gloo_timing: Optional[Timing],
             compare: bool) -> Dict[str, Any]:
    """One output row; the gloo_* fields only with ``compare`` (None where Gloo can't)."""
    factor = busbw_factor(case.op, case.n)
    algbw = case.nbytes / ddl_timing.median_s / 1e9
    row: Dict[str, Any] = {
        "op": case.op, "size": case.nbytes, "count": case.count, "dtype": case.dtype_name,
        "ranks": case.n, "time_us": ddl_timing.median_s * 1e6,
        "min_us": ddl_timing.min_s * 1e6, "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor, "check": _check(ddl_timing),
    }
    if compare:
        g = gloo_timing
        gloo_algbw = case.nbytes / g.median_s / 1e9 if g else None
        row.update({
            "gloo_time_us": g.median_s * 1e6 if g else None,
            "gloo_min_us": g.min_s * 1e6 if g else None,
            "gloo_algbw_gbps": gloo_algbw,
            "gloo_busbw_gbps": gloo_algbw * factor if g else None,
            "gloo_check": _check(g) if g else "n/a",
            "ratio": g.median_s / ddl_timing.median_s if g else None,
        })
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


def run_case(case: Case, args: argparse.Namespace, gloo: Optional[Gloo]) -> Dict[str, Any]:
    """Measure and check ``case`` with ddl, then with Gloo if given; return its row."""
    x = make_input(case)
    expected = expected_output(case)
    iters, warmup = calls_per_case(case, args)
    times, wrong = time_block(ddl_runner(case, x), expected, iters, warmup, args.timing)
    ddl_timing = gather_timing(times, wrong, f"{case.name}/stats/ddl")
    gloo_timing = None
    if gloo is not None and case.dtype_name in GLOO_DTYPES:
        times, wrong = time_block(gloo.runner(case, x, expected), expected, iters, warmup,
                                  args.timing)
        gloo_timing = gather_timing(times, wrong, f"{case.name}/stats/gloo")
    return make_row(case, ddl_timing, gloo_timing, gloo is not None)


def is_wrong(row: Dict[str, Any]) -> bool:
    """Whether any implementation returned a wrong result in ``row``."""
    return row["check"] == "WRONG" or row.get("gloo_check") == "WRONG"


# -- output ---------------------------------------------------------------------------------

_TABLE_COLUMNS = [  # (header, field, alignment and width, format)
    ("op", "op", "<13", "s"), ("size(B)", "size", ">12", "d"),
    ("count", "count", ">11", "d"), ("dtype", "dtype", ">8", "s"),
    ("time(us)", "time_us", ">10", ".1f"), ("algbw(GB/s)", "algbw_gbps", ">11", ".3f"),
    ("busbw(GB/s)", "busbw_gbps", ">11", ".3f"), ("check", "check", ">5", "s"),
]
_GLOO_COLUMNS = [("gloo(us)", "gloo_time_us", ">10", ".1f"),
                 ("gloo_check", "gloo_check", ">10", "s"), ("gloo/ddl", "ratio", ">8", ".2f")]


def _cell(value: Any, width: str, fmt: str) -> str:
    """One table cell; a missing value (Gloo can't run this dtype) reads ``n/a``."""
    if value is None:
        return f"{'n/a':{width}}"
    return f"{value:{width}{fmt}}"


class Report:
    """Rank 0's output: a table streamed row by row, or CSV/JSON written at the end."""

    def __init__(self, args: argparse.Namespace, n: int, out: TextIO) -> None:
        self.args, self.n, self.out = args, n, out
        self.columns = _TABLE_COLUMNS + (_GLOO_COLUMNS if args.compare else [])
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
                   f"{calls}; Sum reductions, broadcast root 0")
        self._line("# time(us): mean over the timed calls made back to back, slowest rank, "
                   "in microseconds" if a.timing == "loop" else
                   "# time(us): median over the calls of the slowest rank's time per call, "
                   "in microseconds")
        self._line(f"# algbw = size / time; busbw = algbw * factor ({factors})")
        if a.compare:
            self._line("# gloo: torch.distributed Gloo on the same buffers; "
                       "gloo/ddl > 1 means ddl is faster")
            if a.dtype not in GLOO_DTYPES:
                self._line(f"# gloo: n/a, Gloo does not support {a.dtype}")
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

def op_cases(op: str, sizes: Sequence[int], dtype_name: str) -> List[Case]:
    """This rank's cases of ``op``, in the order of ``sizes``; requested sizes that round
    to the same size make one case."""
    cases: Dict[int, Case] = {}
    for size in sizes:
        case = make_case(op, size, dtype_name, ddl.rank(), ddl.size())
        cases.setdefault(case.nbytes, case)
    return list(cases.values())


def run_all(args: argparse.Namespace, report: Optional[Report],
            gloo: Optional[Gloo]) -> List[Dict[str, Any]]:
    """Every case, op by op and size by size; rows go to ``report`` (rank 0's) as made."""
    rows = []
    for op in args.op:
        for case in op_cases(op, args.sizes, args.dtype):
            row = run_case(case, args, gloo)
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
    """The benchmark of ``main`` once ddl is up: output file (rank 0), Gloo, every case."""
    out = None
    if ddl.rank() == 0:
        try:
            out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        except OSError as exc:
            print(f"ddl-bench: error: cannot write --output {args.output}: {exc.strerror}",
                  file=sys.stderr)
            return 2
    gloo = Gloo() if args.compare == "gloo" else None
    try:
        report = Report(args, ddl.size(), out) if out is not None else None
        if report is not None:
            report.start()
        rows = run_all(args, report, gloo)
        if report is not None:
            report.finish(rows)
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
        if gloo is not None:
            gloo.close()
    return 1 if any(is_wrong(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
