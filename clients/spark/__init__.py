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
``ddl.shutdown()``. If any rank fails, the stage fails as a whole and :class:`ddl.RunError`
names the rank whose failure came first (the others fail because of it) with its
traceback; a rank's process dies with its task.

Needs pyspark (``pip install 'ddl-train[spark]'``) and a Java runtime; barrier mode
needs ``num_proc`` free task slots at once.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable, List, Mapping, Optional, Sequence

from ddl import RunError
from ddl._client_api import engine_ranks

__all__ = ["run", "RunError"]


def _rank_task(payload: bytes, secret: str, size: int, start_timeout: float,
               env: Mapping[str, str]):
    """What each barrier task runs (on an executor): this task's rank, to its end."""

    def run_partition(_):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        port = engine_ranks.free_port() if rank == 0 else 0
        every = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
        return [engine_ranks.run_rank(payload, rank, size, secret,
                                      f"{every[0]['host']}:{every[0]['port']}",
                                      start_timeout, env)]

    return run_partition


def run(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
        stdout=None, stderr=None, verbose: int = 1, nics=None,
        prefix_output_with_timestamp: bool = False, executable: Optional[str] = None, *,
        spark_context=None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks (default: the context's
    default parallelism) as one ddl job; return the results in rank order (see the
    module doc). ``start_timeout`` (default 60 s) bounds the ranks' start; ``env`` adds
    variables to the ranks' environment; ``spark_context`` defaults to the active one
    (``SparkContext.getOrCreate()``).

    The signature is ``horovod.spark.run``'s. Its ``use_gloo``, ``extra_mpi_args``,
    ``stdout``, ``stderr``, ``verbose``, ``nics``, ``prefix_output_with_timestamp`` and
    ``executable`` are accepted and change nothing (each rank is started by its task,
    and prints to the executor's log); ``use_mpi=True`` is refused: no MPI runs here."""
    if use_mpi:
        raise ValueError("ddl.spark.run: use_mpi=True asks for mpirun, but ddl starts each "
                         "rank from its Spark task and needs no MPI; leave use_mpi unset")
    start_timeout = 60.0 if start_timeout is None else start_timeout
    from pyspark import SparkContext
    sc = spark_context or SparkContext.getOrCreate()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"ddl.spark.run: num_proc must be an int >= 1, got {num_proc!r}")
    task = _rank_task(engine_ranks.pickle_call(fn, args, kwargs), secrets.token_hex(32),
                      num_proc, float(start_timeout), dict(env or {}))
    rows = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task).collect()
    return engine_ranks.results(rows, num_proc, "ddl.spark.run")
