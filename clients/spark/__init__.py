"""ddl on Spark: ``ddl.spark.run(fn, num_proc=N)`` runs ``fn`` as one ddl job of N ranks,
one per task of a Spark barrier stage, and returns the results in rank order.

Each task starts one rank as a fresh Python process (``python -m
ddl.launcher._fn_worker``: the function arrives through an inherited pipe, never argv or
the environment) that starts ddl from environment variables (:mod:`ddl.startup.tcp_rendezvous`):
its rank is the task's partition id, and task 0's address, found with the barrier's
``allGather``, is where the ranks meet. The job secret is made on the driver and reaches
the tasks inside the stage's closure, as Spark ships every task (as Horovod on Spark
does: protect Spark's own RPC with ``spark.authenticate`` and ``spark.network.crypto``
when the cluster is shared); it is never on a command line, and ranks prove it before
rank 0 reads anything.

Cross-rank contract: every rank runs ``fn(*args, **kwargs)`` between ``ddl.init()`` and
``ddl.shutdown()``. If any rank fails, the stage fails as a whole and :class:`RunError`
names the rank whose failure came first (the others fail because of it) with its
traceback; a rank's process dies with its task.

Needs pyspark (``pip install 'ddl-train[spark]'``) and a Java runtime; barrier mode
needs ``num_proc`` free task slots at once.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import ddl

__all__ = ["run", "RunError"]

# Failures that are consequences of another rank's (their tracebacks name these)
_SECONDARY = ("PeerLostError", "CoordinatorLostError", "ShutdownError")


class RunError(ddl.DDLError):
    """A rank of :func:`run` failed: ``rank``, ``exitcode`` (negative: killed by that
    signal) and ``traceback`` (that rank's, or ``""``)."""

    def __init__(self, message: str, *, rank: int, exitcode: int, traceback: str = ""):
        super().__init__(message)
        self.rank, self.exitcode, self.traceback = rank, exitcode, traceback


def _dumps(obj) -> bytes:
    import cloudpickle
    return cloudpickle.dumps(obj)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rank_task(payload: bytes, secret: str, size: int, start_timeout: float,
               extra_env: Mapping[str, str]):
    """The function each barrier task runs (on an executor): start this task's rank,
    feed it the payload, return (rank, exit code, reply)."""

    def run_partition(_) -> List[Tuple[int, int, bytes]]:
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        port = _free_port() if rank == 0 else 0
        every = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
        env.update(extra_env)
        env.update(DDL_RANK=str(rank), DDL_SIZE=str(size), DDL_JOB_SECRET=secret,
                   DDL_RENDEZVOUS_ADDR=f"{every[0]['host']}:{every[0]['port']}",
                   DDL_START_TIMEOUT=str(start_timeout), DDL_LAUNCHER_PID=str(os.getpid()))
        fn_r, fn_w = os.pipe()
        reply_r, reply_w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher._fn_worker", str(fn_r),
                                 str(reply_w)], env=env, pass_fds=(fn_r, reply_w),
                                stdin=subprocess.DEVNULL)
        os.close(fn_r)
        os.close(reply_w)
        reply: List[bytes] = [b""]

        def read() -> None:
            with os.fdopen(reply_r, "rb") as f:
                reply[0] = f.read()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            with os.fdopen(fn_w, "wb") as f:
                f.write(payload)
        except BrokenPipeError:
            pass  # the rank died first; its exit code says how
        code = proc.wait()
        reader.join(5.0)
        return [(rank, code, reply[0])]

    return run_partition


def _failure(rows: Sequence[Tuple[int, int, bytes]], num_proc: int) -> Optional[RunError]:
    """The root-cause failure among the ranks' (rank, code, reply), or None."""
    failed = [(r, c, rep) for r, c, rep in rows if c != 0 or rep[:1] != b"R"]
    if not failed:
        return None
    if len(rows) < num_proc:
        missing = sorted(set(range(num_proc)) - {r for r, _, _ in rows})
        return RunError(f"ddl.spark.run: ranks {missing} sent no result", rank=missing[0],
                        exitcode=1)

    def first(row) -> Tuple[int, int]:
        tb = row[2][1:].decode("utf-8", "replace") if row[2][:1] == b"E" else ""
        return (1 if any(k in tb for k in _SECONDARY) else 0, row[0])

    rank, code, reply = min(failed, key=first)
    tb = reply[1:].decode("utf-8", "replace") if reply[:1] == b"E" else ""
    how = (f"was killed by signal {-code}" if code < 0 else
           f"exited with code {code}" if not tb else "raised")
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    message = f"ddl.spark.run: rank {rank} {how}" + (f": {last}" if last else "")
    others = sorted(r for r, _, _ in failed if r != rank)
    if others:
        message += f" (ranks {others} failed after it)"
    if tb:
        message += f"\nrank {rank} traceback:\n{tb.rstrip()}"
    return RunError(message, rank=rank, exitcode=code or 1, traceback=tb)


def run(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, *, start_timeout: float = 60.0,
        env: Optional[Mapping[str, str]] = None, spark_context=None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks (default: the context's
    default parallelism) as one ddl job; return the results in rank order (see the
    module doc). ``env`` adds variables to the ranks' environment; ``spark_context``
    defaults to the active one (``SparkContext.getOrCreate()``)."""
    from pyspark import SparkContext
    sc = spark_context or SparkContext.getOrCreate()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"ddl.spark.run: num_proc must be an int >= 1, got {num_proc!r}")
    payload = _dumps((fn, tuple(args), dict(kwargs or {})))
    task = _rank_task(payload, secrets.token_hex(32), num_proc, float(start_timeout),
                      dict(env or {}))
    rows = (sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            .collect())
    error = _failure(rows, num_proc)
    if error is not None:
        raise error
    return [pickle.loads(reply[1:]) for _, _, reply in sorted(rows)]
