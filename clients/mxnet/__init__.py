"""ddl.mxnet: ddl for MXNet 1.9 (NDArray and Gluon), the Horovod way.

    import mxnet as mx, ddl.mxnet as ddl
    ddl.init()
    net = Net(); net.initialize()
    ddl.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = ddl.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.01 * ddl.size()})

MXNet 1.9.1 needs numpy < 1.24, so it lives in its own environment
(``make setup-mxnet``: Python 3.11, numpy 1.23.5, mxnet 1.9.1 and ddl). Importing ``ddl``
never imports MXNet.
"""

from __future__ import annotations

try:
    import mxnet as _mx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ddl.mxnet needs MXNet 1.9 (with numpy < 1.24): pip install "
                      "'mxnet==1.9.1' 'numpy==1.23.5' in an environment of its own (in a ddl "
                      "checkout: make setup-mxnet)") from exc

from ddl import (Adasum, Average, Handle, Max, Min, ProcessSet, Product, ReduceOp, Sum,
                 add_process_set, allgather_object, barrier, broadcast_object, cross_rank,
                 cross_size, global_process_set, init, is_initialized, join, local_rank,
                 local_size, rank, register_adapter, remove_process_set, shutdown, size)
from ddl import ccl_built, cuda_built, gloo_built, mpi_built, nccl_built, rocm_built

from ddl.mxnet._adapter import MXNetAdapter
from ddl.mxnet._ops import (allgather, allgather_async, allreduce, allreduce_,
                            allreduce_async, alltoall, broadcast, broadcast_, broadcast_async,
                            grouped_allreduce, grouped_allreduce_, reducescatter, synchronize)
from ddl.mxnet._training import (Compression, DistributedOptimizer, DistributedTrainer,
                                 broadcast_parameters)

register_adapter(MXNetAdapter())

__all__ = ["mpi_built", "gloo_built", "nccl_built", "cuda_built", "rocm_built",
           "ccl_built", "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
           "cross_rank", "cross_size", "allreduce", "allreduce_", "allreduce_async",
           "grouped_allreduce", "grouped_allreduce_", "allgather", "allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "alltoall", "reducescatter",
           "synchronize", "barrier", "join", "Handle", "broadcast_object", "allgather_object",
           "DistributedOptimizer", "DistributedTrainer", "broadcast_parameters", "Compression",
           "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "ProcessSet",
           "add_process_set", "remove_process_set", "global_process_set"]
