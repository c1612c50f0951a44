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

from ddl import _common_api
from ddl._common_api import *  # noqa: F401,F403  (the framework-neutral API, as in ddl)

from ddl.tensorflow._ops import (allgather, allgather_object, allreduce, alltoall, broadcast,
                                 broadcast_object, broadcast_object_fn, grouped_allgather,
                                 grouped_allreduce, grouped_reducescatter, in_order,
                                 reducescatter)
from ddl.tensorflow._query_ops import (local_rank_op, local_size_op, process_set_included_op,
                                       rank_op, size_op)
from ddl.tensorflow._sync_batch_norm import SyncBatchNormalization
from ddl.tensorflow._gradients import reduce_gradients
from ddl.tensorflow._training import (BroadcastGlobalVariablesHook, Compression,
                                      DistributedGradientTape, DistributedOptimizer,
                                      PartialDistributedGradientTape,
                                      broadcast_, broadcast_global_variables,
                                      broadcast_variables)
from ddl.tensorflow import elastic

__all__ = [
    *_common_api.__all__,
    # collectives as TensorFlow ops
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter", "in_order", "broadcast_object_fn",
    # topology as ops, read when they run
    "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op",
    # training
    "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape",
    "SyncBatchNormalization", "Compression", "broadcast_variables", "broadcast_",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "reduce_gradients",
    "elastic",
]
