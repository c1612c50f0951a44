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

from ddl import Handle, register_adapter
from ddl import _common_api
from ddl._common_api import *  # noqa: F401,F403  (the framework-neutral API, as in ddl)

from ddl.mxnet._adapter import MXNetAdapter
from ddl.mxnet._ops import (allgather, allgather_async, allreduce, allreduce_,
                            allreduce_async, alltoall, broadcast, broadcast_, broadcast_async,
                            grouped_allgather, grouped_allreduce, grouped_allreduce_,
                            grouped_reducescatter, poll, reducescatter, synchronize)
from ddl.mxnet._training import (Compression, DistributedOptimizer, DistributedTrainer,
                                 broadcast_parameters)

register_adapter(MXNetAdapter())

__all__ = [
    *_common_api.__all__,
    # collectives on NDArrays
    "allreduce", "allreduce_", "allreduce_async", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "allgather_async", "grouped_allgather", "broadcast", "broadcast_",
    "broadcast_async", "alltoall", "reducescatter", "grouped_reducescatter", "synchronize",
    "poll", "Handle",
    # training
    "DistributedOptimizer", "DistributedTrainer", "broadcast_parameters", "Compression",
]
