"""The collectives of ``ddl.keras``: ddl.tensorflow's ops with Horovod's Keras signatures
(``allreduce(value, name, average, ...)``: the name comes second here, as in
``horovod.tensorflow.keras``). Each returns a TensorFlow tensor."""

from __future__ import annotations

from typing import Optional

import ddl.tensorflow as _tf_ops
from ddl import ProcessSet, ReduceOp, global_process_set
from ddl._client_api import Compressor
from ddl.tensorflow import Compression


def allreduce(value, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[ReduceOp] = None, compression: Compressor = Compression.none,
              process_set: ProcessSet = global_process_set):
    """Reduce ``value`` (a tensor, array or number) across the process set (default
    Average), e.g. a metric at the end of an epoch."""
    return _tf_ops.allreduce(value, average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, name=name,
                             process_set=process_set)


def allgather(value, name: Optional[str] = None, process_set: ProcessSet = global_process_set):
    """Every member's ``value`` concatenated along dim 0, in rank order."""
    return _tf_ops.allgather(value, name=name, process_set=process_set)


def broadcast(value, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set):
    """``root_rank``'s ``value`` on every member."""
    return _tf_ops.broadcast(value, root_rank, name=name, process_set=process_set)


def reducescatter(value, name: Optional[str] = None, op: Optional[ReduceOp] = None,
                  process_set: ProcessSet = global_process_set):
    """Reduce across members (default Average); member i keeps block i of dim 0."""
    return _tf_ops.reducescatter(value, op=op, name=name, process_set=process_set)
