"""Collectives on NDArrays: new arrays (same dtype and context), in-place forms with a
trailing underscore, and asynchronous forms returning a :class:`ddl.Handle`.

The signatures are Horovod's, positions included; ``priority`` (an MXNet engine priority
there) is accepted and changes nothing: ddl's leader orders the collectives.

Cross-rank contract: as for :mod:`ddl` (same names, dtypes and shapes on every member of
the process set, in any order).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mxnet as mx

import ddl
from ddl import ProcessSet, ReduceOp, global_process_set
from ddl._client_api import client_reduce_op


def allreduce(tensor, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Optional[ReduceOp] = None):
    """``tensor`` reduced across the process set (default ``Average``); a new NDArray."""
    return ddl.allreduce(tensor, name=name, op=client_reduce_op(op, average),
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         process_set=process_set)


def allreduce_(tensor, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
               op: Optional[ReduceOp] = None):
    """In place: ``tensor`` holds the reduction afterwards; returns it."""
    tensor[:] = allreduce(tensor, average, name, priority, prescale_factor,
                          postscale_factor, process_set, op)
    return tensor


def allreduce_async(tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    priority: int = 0, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set,
                    op: Optional[ReduceOp] = None) -> ddl.Handle:
    """Start an allreduce; ``handle.wait()`` (or :func:`synchronize`) gives the NDArray."""
    return ddl.allreduce_async(tensor, name=name, op=client_reduce_op(op, average),
                               prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce(tensors: Sequence, average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op: Optional[ReduceOp] = None) -> List:
    """Several NDArrays reduced as one fused group; a list of new NDArrays."""
    return ddl.grouped_allreduce(list(tensors), name=name, op=client_reduce_op(op, average),
                                 prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce_(tensors: Sequence, average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: Optional[ReduceOp] = None) -> List:
    """In place, for each NDArray of the group; returns them."""
    for t, r in zip(tensors, grouped_allreduce(tensors, average, name, priority,
                                               prescale_factor, postscale_factor,
                                               process_set, op)):
        t[:] = r
    return list(tensors)


def allgather(tensor, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set):
    """Every member's ``tensor`` concatenated along axis 0, in rank order."""
    return ddl.allgather(tensor, name=name, process_set=process_set)


def allgather_async(tensor, name: Optional[str] = None, priority: int = 0,
                    process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`allgather`: ``synchronize(handle)`` returns the NDArray."""
    return ddl.allgather_async(tensor, name=name, process_set=process_set)


def broadcast(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set):
    """``root_rank``'s ``tensor`` on every member; a new NDArray."""
    return ddl.broadcast(tensor, root_rank, name=name, process_set=process_set)


def broadcast_(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set):
    """In place: ``tensor`` holds the root's values afterwards; returns it."""
    tensor[:] = broadcast(tensor, root_rank, name, priority, process_set)
    return tensor


def broadcast_async(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0,
                    process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`broadcast`: ``synchronize(handle)`` returns the NDArray."""
    return ddl.broadcast_async(tensor, root_rank, name=name, process_set=process_set)


def alltoall(tensor, splits=None, name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set):
    """Rows of ``tensor`` to every member: the received rows, and with ``splits`` given
    (a list or an NDArray) also how many came from each member, ``(received,
    received_splits)``: ``received_splits`` an int32 NDArray on the CPU, as Horovod's."""
    given = splits is not None
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy().tolist()
    out, received = ddl.alltoall(tensor, splits=splits, name=name, process_set=process_set)
    if not given:
        return out
    return out, mx.nd.array(received, ctx=mx.cpu(), dtype="int32")


def reducescatter(tensor, op: Optional[ReduceOp] = None, name: Optional[str] = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduced across members (default Average); member i keeps block i of axis 0."""
    return ddl.reducescatter(tensor, name=name,
                             op=ReduceOp.Average if op is None else ReduceOp(op),
                             process_set=process_set, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)


def grouped_allgather(tensors: Sequence, name: Optional[str] = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> List:
    """Allgather a list of NDArrays as one group (one negotiation); a list of NDArrays."""
    return ddl.grouped_allgather(list(tensors), name=name, process_set=process_set)


def grouped_reducescatter(tensors: Sequence, op: Optional[ReduceOp] = None,
                          name: Optional[str] = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> List:
    """Reduce-scatter a list of NDArrays as one group (default Average); a list of
    NDArrays, each this member's block of axis 0."""
    return ddl.grouped_reducescatter(list(tensors), name=name,
                                     op=ReduceOp.Average if op is None else ReduceOp(op),
                                     process_set=process_set,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)


def synchronize(handle: ddl.Handle):
    """The result of an asynchronous call (waits for it)."""
    return handle.wait()


def poll(handle: ddl.Handle) -> bool:
    """Whether the asynchronous call finished; never blocks."""
    return handle.poll()
