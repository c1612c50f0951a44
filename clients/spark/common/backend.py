"""Horovod's ``horovod.spark.common.backend``: where an estimator's fit runs. A
:class:`SparkBackend` runs it with ``ddl.spark.run`` on the active Spark context, with
the settings given here (the ranks' number, environment, output streams, start
timeout), so an estimator made with ``backend=SparkBackend(num_proc=4, stdout=...)``
trains as Horovod's did."""

from __future__ import annotations

import abc
from typing import IO, Any, Callable, List, Mapping, Optional, Sequence

__all__ = ["Backend", "SparkBackend"]


class Backend(abc.ABC):
    """What an estimator needs of a backend: :meth:`run` and :meth:`num_processes`."""

    @abc.abstractmethod
    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[Mapping] = None,
            env: Optional[Mapping[str, str]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank of one ddl job: the results in rank
        order."""

    @abc.abstractmethod
    def num_processes(self) -> int:
        """How many ranks :meth:`run` starts."""


class SparkBackend(Backend):
    """Horovod's ``SparkBackend``, its keywords in its order: ``num_proc`` (default:
    Spark's default parallelism), ``env`` (added to the ranks' environment),
    ``stdout``/``stderr`` (the ranks' lines, prefixed ``[rank]<stdout>:``), ``verbose``,
    ``nics``, ``start_timeout``, ``prefix_output_with_timestamp``; the MPI and Gloo
    choices (``use_mpi``, ``use_gloo``, ``extra_mpi_args``) are as ``ddl.spark.run``
    takes them (``use_mpi=True`` is refused there)."""

    def __init__(self, num_proc: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
                 verbose: int = 1, nics=None, start_timeout: Optional[float] = None,
                 use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
                 extra_mpi_args: Optional[str] = None,
                 prefix_output_with_timestamp: bool = False, **kwargs: Any):
        unknown = sorted(set(kwargs) - {"run_func", "key", "spark_context"})
        if unknown:
            raise TypeError(f"SparkBackend: unexpected argument(s) {', '.join(unknown)}")
        self._num_proc = num_proc
        self._spark_context = kwargs.get("spark_context")
        self._run_kwargs = dict(env=dict(env or {}), stdout=stdout, stderr=stderr,
                                verbose=verbose, nics=nics, start_timeout=start_timeout,
                                use_mpi=use_mpi, use_gloo=use_gloo,
                                extra_mpi_args=extra_mpi_args,
                                prefix_output_with_timestamp=prefix_output_with_timestamp)

    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[Mapping] = None,
            env: Optional[Mapping[str, str]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on :meth:`num_processes` Spark tasks as one ddl job
        (``ddl.spark.run``): the results in rank order."""
        import ddl.spark
        run_kwargs = dict(self._run_kwargs)
        run_kwargs["env"] = dict(run_kwargs["env"], **(env or {}))
        return ddl.spark.run(fn, args=tuple(args), kwargs=kwargs,
                             num_proc=self.num_processes(),
                             spark_context=self._context(), **run_kwargs)

    def num_processes(self) -> int:
        return self._num_proc or self._context().defaultParallelism

    def _context(self) -> Any:
        if self._spark_context is None:
            from pyspark import SparkContext
            return SparkContext.getOrCreate()
        return self._spark_context
