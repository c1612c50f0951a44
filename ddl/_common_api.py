"""The framework-neutral part of ddl's API, which every framework client re-exports as is.

A Horovod script calls ``hvd.rank()``, ``hvd.mpi_enabled()``, ``hvd.start_timeline()`` or
catches ``hvd.PeerLostError`` whichever framework ``hvd`` is, so ``ddl.torch``,
``ddl.tensorflow``, ``ddl.keras``, ``ddl.mxnet`` and ``ddl.jax`` each take these names
from here (``from ddl._common_api import *``) and list them first in their ``__all__``
(``[*_common_api.__all__, ...]``); their collectives are their own, and a client may
redefine one of these where Horovod's signature differs (``ddl.torch.join(device)``).
Otherwise they are the very objects of :mod:`ddl`: a process set, a reduce op or an error
class is the same whichever module names it.
"""

from __future__ import annotations

from ddl import (Adasum, Average, BootstrapError, ConfigError, CoordinatorLostError,
                 DDLError, DDLTimeoutError, DuplicateNameError, FatalError, HandshakeError,
                 HorovodInternalError,
                 HostsUpdatedInterrupt, InvalidRequestError, Max, Min, MismatchError,
                 MPINotEnabledError, NotEnoughRanksError, NotInitializedError, PeerLostError,
                 ProcessSet, Product, ReduceOp, ShutdownError, StallError, Sum,
                 add_process_set, allgather_object, barrier, broadcast_object, ccl_built,
                 comm_process_set_id, ddl_built, get_process_set_ids_and_ranks,
                 cross_rank, cross_size, cuda_built, gloo_built, gloo_enabled,
                 global_process_set, init, is_homogeneous, is_initialized, join, local_rank,
                 local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                 remove_process_set, rocm_built, shutdown, size, start_timeline,
                 stop_timeline, sycl_built)

__all__ = [
    # lifecycle and topology
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous",
    # MPI, and what this build has (Horovod's queries)
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "cuda_built", "rocm_built", "ccl_built", "sycl_built", "ddl_built",
    # diagnostics
    "start_timeline", "stop_timeline",
    # coordination without tensors
    "barrier", "join", "broadcast_object", "allgather_object",
    # reduce ops
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum",
    # process sets
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "get_process_set_ids_and_ranks", "comm_process_set_id",
    # errors
    "DDLError", "ConfigError", "NotInitializedError", "DuplicateNameError", "MismatchError",
    "InvalidRequestError", "FatalError", "PeerLostError", "CoordinatorLostError",
    "StallError", "ShutdownError", "DDLTimeoutError", "HandshakeError", "BootstrapError",
    "MPINotEnabledError", "HostsUpdatedInterrupt", "NotEnoughRanksError",
    "HorovodInternalError",
]
