"""ddl-bench's command line: the parser, its help (what SIZE means) and the checks that
stop a run before ddl starts, with a message on rank 0 only."""

from __future__ import annotations

import argparse
import os
import re
from typing import Callable, List, Optional, Sequence, TextIO

from ddl.bench._cases import DTYPES, OPS, REDUCE_OPS
from ddl.bench._peers import PEERS
from ddl.bench._timing import (LARGE_ITERS, LARGE_WARMUP, SMALL_CASE_BYTES, SMALL_ITERS,
                               SMALL_WARMUP)
from ddl.core.errors import ConfigError
from ddl.startup import mpi as _mpi

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
