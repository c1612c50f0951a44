"""ddl.tensorflow: ddl for TensorFlow 2 (eager, ``tf.function``) and ``tf.compat.v1`` graphs.

The four changes, as with Horovod::

    import tensorflow as tf, ddl.tensorflow as ddl
    ddl.init()
    opt = tf.keras.optimizers.SGD(0.01 * ddl.size())
    ...
    with tf.GradientTape() as tape:
        loss = ...
    tape = ddl.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_step:
        ddl.broadcast_variables(model.variables, root_rank=0)
        ddl.broadcast_variables(opt.variables, root_rank=0)

Collectives are TensorFlow operations (see :mod:`ddl.tensorflow._ops`). Importing
``ddl`` never imports TensorFlow; this module needs it (``pip install 'ddl-train[tensorflow]'``).
"""

from __future__ import annotations

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ddl.tensorflow needs TensorFlow: pip install "
                      "'tensorflow>=2.21,<2.22' 'keras>=3.15,<4' (CPU or GPU; in a ddl "
                      "checkout: pip install -e '.[tensorflow]')") from exc

from ddl import (Average, DDLError, Max, Min, MismatchError, PeerLostError, ProcessSet,
                 Product, ReduceOp, Sum, Adasum, add_process_set, allgather_object, barrier,
                 broadcast_object, cross_rank, cross_size, global_process_set, init,
                 is_initialized, join, local_rank, local_size, rank, remove_process_set,
                 shutdown, size)
from ddl import ccl_built, cuda_built, gloo_built, mpi_built, nccl_built, rocm_built

from ddl.tensorflow._ops import (allgather, allreduce, alltoall, broadcast, grouped_allreduce,
                                 in_order, reducescatter)
from ddl.tensorflow._sync_batch_norm import SyncBatchNormalization
from ddl.tensorflow._training import (BroadcastGlobalVariablesHook, Compression,
                                      DistributedGradientTape, DistributedOptimizer,
                                      PartialDistributedGradientTape,
                                      broadcast_global_variables, broadcast_variables,
                                      reduce_gradients)
from ddl.tensorflow import elastic

__all__ = [
    # what this build has (Horovod's queries)
    "mpi_built", "gloo_built", "nccl_built", "cuda_built", "rocm_built", "ccl_built",
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "allreduce", "grouped_allreduce", "allgather", "broadcast",
    "alltoall", "reducescatter", "in_order", "barrier", "join", "broadcast_object", "allgather_object",
    "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape",
    "SyncBatchNormalization", "Compression", "broadcast_variables",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "reduce_gradients",
    "elastic",
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "ProcessSet",
    "add_process_set",
    "remove_process_set", "global_process_set", "DDLError", "MismatchError",
    "PeerLostError",
]
