"""ddl-bench's measurements: each case with ddl, then each --compare implementation and
the floor, into a row."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ddl.bench._cases import Case, expected_output, make_input, op_cases
from ddl.bench._devices import input_device, to_cupy
from ddl.bench._floor import FLOOR_MIN_BYTES, copy_floor, pingpong_floor
from ddl.bench._report import Report, make_row
from ddl.bench._timing import Timing, calls_per_case, ddl_runner, gather_timing, time_block


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
