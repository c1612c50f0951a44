"""How ddl-bench times a case: how many calls, a block of warm-up and timed calls checked
against the expected result, every rank's times combined, and ddl's own call."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Callable, Tuple

import numpy as np

import ddl
from ddl.bench._cases import Case, same
from ddl.bench._devices import device_sync

# calls per case by default: many for small cases, few for large ones
SMALL_CASE_BYTES = 64 * 1024
SMALL_ITERS, SMALL_WARMUP = 1000, 100
LARGE_ITERS, LARGE_WARMUP = 20, 5


def calls_per_case(case: Case, args: argparse.Namespace) -> Tuple[int, int]:
    """(timed calls, warm-up calls) of ``case``: ``--iters`` and ``--warmup``, or by default
    many for small cases (as OSU's benchmarks do: a short block is dominated by how the
    ranks settle into step, especially with more ranks than cores), few for large ones."""
    small = case.nbytes <= SMALL_CASE_BYTES
    iters = args.iters if args.iters is not None else (SMALL_ITERS if small else LARGE_ITERS)
    warmup = args.warmup if args.warmup is not None else (
        SMALL_WARMUP if small else LARGE_WARMUP)
    return iters, warmup


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
