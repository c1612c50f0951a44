"""ddl.torch: ddl for PyTorch, the Horovod way.

Four changes make a single-process training script distributed::

    import torch, ddl.torch as ddl
    ddl.init()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * ddl.size())
    opt = ddl.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    ddl.broadcast_parameters(model.state_dict(), root_rank=0)
    ddl.broadcast_optimizer_state(opt, root_rank=0)

then ``ddlrun -np 4 python train.py``. Everything in :mod:`ddl` is here too; the
collectives take and return torch tensors (same dtype and device; CPU tensors reach the
data plane without a copy when contiguous, CUDA tensors are staged through host memory),
and have in-place (``allreduce_``) and differentiable forms. Pure Python: nothing here is
compiled against torch.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ddl.torch needs PyTorch: pip install 'torch>=2.1' (in a ddl "
                      "checkout: pip install -e '.[torch]')") \
        from exc

from ddl import (Average, ConfigError, CoordinatorLostError, DDLError, DDLTimeoutError,
                 DuplicateNameError, FatalError, Handle, InvalidRequestError, Max, Min,
                 MismatchError, NotInitializedError, PeerLostError, ProcessSet, Product, Adasum,
                 ReduceOp, ShutdownError, StallError, Sum, add_process_set, barrier,
                 cross_rank, cross_size, global_process_set, init, is_homogeneous,
                 is_initialized, join, local_rank, local_size, rank, register_adapter,
                 remove_process_set, shutdown, size, start_timeline, stop_timeline)
from ddl import ccl_built, cuda_built, gloo_built, mpi_built, nccl_built, rocm_built

from ddl.torch._adapter import TorchAdapter
from ddl.torch._compression import Compression
from ddl.torch._ops import (allgather, allgather_async, allreduce, allreduce_,
                            allreduce_async, allreduce_async_, alltoall, alltoall_async,
                            broadcast, broadcast_, broadcast_async, broadcast_async_,
                            grouped_allgather, grouped_allreduce, grouped_allreduce_async,
                            grouped_reducescatter, poll, reducescatter,
                            reducescatter_async, synchronize)
from ddl.torch._optimizer import DistributedOptimizer
from ddl import allgather_object, broadcast_object
from ddl.torch._state import broadcast_optimizer_state, broadcast_parameters
from ddl.torch._sync_batch_norm import SyncBatchNorm
from ddl.torch import elastic

register_adapter(TorchAdapter())

__all__ = [
    # what this build has (Horovod's queries)
    "mpi_built", "gloo_built", "nccl_built", "cuda_built", "rocm_built", "ccl_built",
    # lifecycle and topology
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    # collectives on tensors
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allgather", "grouped_reducescatter", "allgather",
    "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "join", "synchronize", "poll", "Handle",
    # training
    "DistributedOptimizer", "Compression", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "SyncBatchNorm",
    "elastic",
    # reduce ops, process sets, errors
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "ProcessSet",
    "add_process_set",
    "remove_process_set", "global_process_set", "DDLError", "ConfigError",
    "NotInitializedError", "DuplicateNameError", "MismatchError", "InvalidRequestError",
    "FatalError", "PeerLostError", "CoordinatorLostError", "StallError", "ShutdownError",
    "DDLTimeoutError",
]
