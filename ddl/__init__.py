"""ddl: distributed deep-learning training with functional collectives.

Four changes make a single-process script distributed: ``ddl.init()``, scale the
learning rate by ``ddl.size()``, wrap the optimizer, broadcast the initial state. Then
``ddlrun -np 4 python train.py``.

This module is the whole public API; everything else is internal.
"""

from __future__ import annotations

# First: move the launcher's job secret out of the environment, before the program can
# start a process that would inherit it (ddl keeps it; see ddl.core.config.take_job_secret).
from ddl.core.config import take_job_secret as _take_job_secret

_take_job_secret()

# Also first, before gRPC loads: gRPC's own fork handlers (grpcio 1.81 and later) restart
# its poller thread in a forked child, where subprocess then closes the poller's fd before
# exec, and the child dies before it runs the program (grpc/grpc#43055): about one in a
# hundred children started with preexec_fn after ddl.init() (PySpark's JVM, for one), and
# every fork logs. No ddl process uses gRPC on both sides of a fork, so it needs none of
# them; a program that does can still set GRPC_ENABLE_FORK_SUPPORT=true itself.
import os as _os  # noqa: E402

_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from ddl._adapters import ArrayAdapter, register_adapter
from ddl._build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                        nccl_built, rocm_built, sycl_built)
from ddl._api import (allgather, allgather_async, allreduce, allreduce_async, alltoall,
                      alltoall_async, barrier, broadcast, broadcast_async, grouped_allgather,
                      grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
                      grouped_reducescatter, grouped_reducescatter_async, join, poll,
                      reducescatter, reducescatter_async, synchronize)
from ddl._membership import add_process_set, init, remove_process_set
from ddl._objects import allgather_object, broadcast_object
from ddl._process_sets import (ProcessSet, comm_process_set_id, get_process_set_ids_and_ranks,
                              global_process_set)
from ddl.core.dtypes import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ddl.core.errors import (BootstrapError, ConfigError, CoordinatorLostError, DDLError,
                             DDLTimeoutError, DuplicateNameError, FatalError, HandshakeError,
                             HorovodInternalError, HostsUpdatedInterrupt,
                             InvalidRequestError, MismatchError,
                             MPINotEnabledError, NotEnoughRanksError, NotInitializedError,
                             PeerLostError, ShutdownError, StallError)
from ddl.launcher import RunError, run
from ddl.runtime.handle import Handle
from ddl.runtime.runtime import is_initialized
from ddl.runtime.runtime import runtime as _current_runtime
from ddl.runtime.runtime import shutdown, start_timeline, stop_timeline
from ddl.runtime.runtime import topology as _topology
from ddl.startup import mpi as _mpi
from ddl.startup.mpi import mpi_built

__version__ = "0.1.0"


def size() -> int:
    """Number of processes in the job."""
    return _topology().size


def rank() -> int:
    """This process's global rank, in ``[0, size())``."""
    return _topology().rank


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _topology().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _topology().local_size


def cross_rank() -> int:
    """Index of this host among the hosts that have a process with this local rank."""
    return _topology().cross_rank


def cross_size() -> int:
    """Number of hosts that have a process with this local rank."""
    return _topology().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return _topology().is_homogeneous


def mpi_enabled() -> bool:
    """Whether MPI started this job (``mpirun``/``srun``, ``ddlrun --mpi`` or
    ``init(comm=...)``); False under plain ``ddlrun``, ``ddl.run`` or as one process.
    Local to each rank; needs ``init`` (NotInitializedError before)."""
    return _current_runtime().mpi is not None


def mpi_threads_supported() -> bool:
    """Whether the MPI library provides MPI_THREAD_MULTIPLE (mpi4py asks for it), so other
    threads may call MPI while ddl runs. Raises MPINotEnabledError in a job that MPI did
    not start, ConfigError when mpi4py is missing; needs ``init``."""
    return _mpi.threads_supported(_current_runtime().mpi)




__all__ = [
    # lifecycle and topology
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "run", "RunError",
    # MPI, and what this build has
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built",
    "cuda_built", "rocm_built", "ccl_built", "sycl_built", "ddl_built",
    # diagnostics
    "start_timeline", "stop_timeline",
    # collectives
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "join",
    "synchronize", "poll", "Handle", "broadcast_object", "allgather_object",
    # reduce ops
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum",
    # process sets
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "get_process_set_ids_and_ranks", "comm_process_set_id",
    # adapters
    "ArrayAdapter", "register_adapter",
    # errors
    "DDLError", "ConfigError", "NotInitializedError", "DuplicateNameError", "MismatchError",
    "InvalidRequestError", "FatalError", "HorovodInternalError", "PeerLostError",
    "CoordinatorLostError", "StallError", "ShutdownError", "DDLTimeoutError",
    "HandshakeError", "BootstrapError",
    "MPINotEnabledError", "HostsUpdatedInterrupt", "NotEnoughRanksError",
]


def __getattr__(name: str):
    """``ddl.elastic`` without importing it first (it is loaded on first use)."""
    if name == "elastic":
        import importlib
        return importlib.import_module("ddl.elastic")
    raise AttributeError(f"module 'ddl' has no attribute {name!r}")
