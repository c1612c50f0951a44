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

The modules, one job each: ``_cli`` (the command line and its checks), ``_cases`` (a
case, its inputs and expected results), ``_devices`` (host, CuPy and torch buffers),
``_timing`` (calls per case, timed blocks, every rank's times combined), ``_peers`` (the
--compare implementations), ``_floor`` (the copy and ping-pong floors), ``_measure``
(each case into a row), ``_report`` (a row's fields, the table, CSV, JSON); this module
runs them (:func:`main`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import ddl
from ddl.bench._cases import DTYPES as DTYPES
from ddl.bench._cases import OPS as OPS
from ddl.bench._cases import REDUCE_OPS as REDUCE_OPS
from ddl.bench._cases import REDUCING_OPS as REDUCING_OPS
from ddl.bench._cases import Case as Case
from ddl.bench._cases import busbw_factor as busbw_factor
from ddl.bench._cases import exact_output as exact_output
from ddl.bench._cases import expected_output as expected_output
from ddl.bench._cases import make_case as make_case
from ddl.bench._cases import make_input as make_input
from ddl.bench._cases import pattern as pattern
from ddl.bench._cases import pattern_modulus as pattern_modulus
from ddl.bench._cli import parse_args as parse_args
from ddl.bench._cli import parse_size_list as parse_size_list
from ddl.bench._cli import size_range as size_range
from ddl.bench._floor import FLOOR_MIN_BYTES as FLOOR_MIN_BYTES
from ddl.bench._measure import run_all
from ddl.bench._peers import CompareError as CompareError
from ddl.bench._peers import close_peers, start_peers
from ddl.bench._report import Report, is_wrong

__all__ = ["DTYPES", "OPS", "REDUCE_OPS", "REDUCING_OPS", "FLOOR_MIN_BYTES", "Case",
           "CompareError", "busbw_factor", "exact_output", "expected_output", "main",
           "make_case", "make_input", "parse_args", "parse_size_list", "pattern",
           "pattern_modulus", "size_range"]


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

