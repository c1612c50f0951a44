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

from ddl import Handle, register_adapter
from ddl import _common_api
from ddl._common_api import *  # noqa: F401,F403  (the framework-neutral API, as in ddl)

from ddl.torch._adapter import TorchAdapter
from ddl.torch._compression import Compression
from ddl.torch._ops import (allgather, allgather_async, allreduce, allreduce_,
                            allreduce_async, allreduce_async_, alltoall, alltoall_async,
                            broadcast, broadcast_, broadcast_async, broadcast_async_,
                            grouped_allgather, grouped_allgather_async, grouped_allreduce,
                            grouped_allreduce_, grouped_allreduce_async,
                            grouped_allreduce_async_, grouped_reducescatter,
                            grouped_reducescatter_async, join, poll, reducescatter,
                            reducescatter_async, sparse_allreduce_async, synchronize)
from ddl.torch._optimizer import DistributedOptimizer
from ddl.torch._state import broadcast_optimizer_state, broadcast_parameters
from ddl.torch._sync_batch_norm import SyncBatchNorm
from ddl.torch import elastic

register_adapter(TorchAdapter())

__all__ = [
    *_common_api.__all__,
    # collectives on tensors
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "synchronize", "poll", "Handle",
    # training
    "DistributedOptimizer", "Compression", "broadcast_parameters",
    "broadcast_optimizer_state", "SyncBatchNorm", "elastic",
]
