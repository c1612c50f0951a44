"""Collectives on torch tensors: functional, in place, asynchronous, and differentiable.

Cross-rank contract: as for the core collectives (:mod:`ddl._api`): every member of the
process set makes the same call under the same ``name`` with a tensor of the same dtype
and shape (allgather: the same shape after dim 0). Results keep the input's dtype and
device; the functional forms never modify their input.

Every collective but the sparse allreduce is differentiable when its input requires a
gradient, with Horovod's gradients (:mod:`ddl.torch._autograd`): every rank must then
run backward through the same calls.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import numpy as np
import torch

import ddl
from ddl import ProcessSet, ReduceOp, global_process_set
from ddl._client_api import Compressor, check_rows_agree, client_reduce_op, refuse

from ddl.torch import _autograd
from ddl.torch._compression import Compression

Average, Sum = ReduceOp.Average, ReduceOp.Sum


# a sparse allreduce's group: its dense shape (named as the call), indices and values
SPARSE_PARTS = ("", "indices", "values")


def _takes_tensors(fn):
    """A collective's first argument checked: a torch.Tensor (``grouped_*``: an iterable
    of them, such as ``model.parameters()``, passed on as a list), else a TypeError
    naming the function, what it got, and the way to reduce other arrays (ddl's own
    collectives). The other members' call of the name fails at once too
    (:func:`ddl._client_api.refuse`)."""
    grouped = fn.__name__.startswith("grouped_")
    keyword = "tensors" if grouped else "tensor"
    signature = inspect.signature(fn)
    core = fn.__name__.rstrip("_")
    op = core.replace("_async", "").replace("grouped_", "")
    keys: tuple = ()
    if op == "sparse_allreduce":  # one grouped allgather (see _SparseAllreduce)
        op, keys = "allgather", SPARSE_PARTS

    def refused(takes: str, got: str, hint: str, args, kwargs, length: int = 1):
        error = TypeError(f"ddl.torch.{fn.__name__} takes {takes}, not {got}{hint}")
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            raise error from None
        refuse(op, f"passed {got} to ddl.torch.{fn.__name__}, which takes {takes}", error,
               name=bound.get("name"), group=length if grouped else 0, keys=keys,
               process_set=bound.get("process_set", global_process_set))

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if not args and keyword not in kwargs:
            return fn(*args, **kwargs)   # its own TypeError names what is missing
        x = args[0] if args else kwargs[keyword]
        if grouped:
            takes = "a list of torch.Tensors"
            if isinstance(x, torch.Tensor) or not hasattr(x, "__iter__"):
                refused(takes, type(x).__name__, "", args, kwargs)
            x = list(x)   # (a generator is read once, here)
            if not all(isinstance(t, torch.Tensor) for t in x):
                refused(takes, f"a list holding {sorted({type(t).__name__ for t in x})}", "",
                        args, kwargs, len(x))
            if args:
                args = (x,) + args[1:]
            else:
                kwargs[keyword] = x
        elif not isinstance(x, torch.Tensor):
            refused("a torch.Tensor", type(x).__name__,
                    "; convert it (torch.as_tensor)" + (
                        f", or call ddl.{core} for NumPy and other arrays"
                        if core in ddl.__all__ else ""), args, kwargs)
        return fn(*args, **kwargs)
    return checked


def _needs_grad(tensor: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


# -- allreduce ------------------------------------------------------------------------------

@_takes_tensors
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Compressor = Compression.none, op: Optional[ReduceOp] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the process set (default ``Average``); a new tensor.

    ``compression`` casts the tensor for the wire and back (``Compression.fp16``).
    Differentiable (Sum and Average) when ``tensor`` requires a gradient.

    Example::

        mean_loss = ddl.torch.allreduce(loss.detach(), name="loss")
    """
    op = client_reduce_op(op, average)
    wire, cctx = compression.compress(tensor)
    if _needs_grad(wire):
        out = _autograd.Allreduce.apply(wire, name, op, prescale_factor, postscale_factor,
                               process_set)
    else:
        out = ddl.allreduce(wire, name=name, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(out, cctx)


class _InPlace:
    """The handle of an in-place asynchronous collective: ``wait()`` copies the result
    into the tensor (a grouped call: each result into its tensor) and returns it
    (``ddl.torch.synchronize`` does the same)."""

    def __init__(self, handle: ddl.Handle, tensor, decompress=None):
        self._handle, self._tensor, self._decompress = handle, tensor, decompress
        self._done = False

    def poll(self) -> bool:
        return self._handle.poll()

    def wait(self, timeout: Optional[float] = None):
        if not self._done:
            out = self._handle.wait(timeout)
            if self._decompress is not None:
                out = self._decompress(out)
            grouped = isinstance(self._tensor, list)
            with torch.no_grad():
                for dst, src in zip(self._tensor if grouped else [self._tensor],
                                    out if grouped else [out]):
                    dst.copy_(src)
            self._done = True
        return self._tensor


class _Decompressed:
    """An asynchronous result that is decompressed when waited for."""

    def __init__(self, handle: ddl.Handle, compression, cctx):
        self._handle, self._compression, self._ctx = handle, compression, cctx

    def poll(self) -> bool:
        return self._handle.poll()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        return self._compression.decompress(self._handle.wait(timeout), self._ctx)


@_takes_tensors
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, compression: Compressor = Compression.none,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set):
    """Asynchronous :func:`allreduce` (not differentiable); ``synchronize(handle)`` or
    ``handle.wait()`` returns the result."""
    op = client_reduce_op(op, average)
    wire, cctx = compression.compress(tensor.detach())
    handle = ddl.allreduce_async(wire, name=name, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set)
    if compression is Compression.none:
        return handle
    return _Decompressed(handle, compression, cctx)


@_takes_tensors
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None,
               name: Optional[str] = None, op: Optional[ReduceOp] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set).wait()


@_takes_tensors
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[ReduceOp] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> _InPlace:
    """Asynchronous in-place allreduce: ``synchronize(handle)`` writes the result into
    ``tensor`` and returns it. Do not use ``tensor`` until then."""
    op = client_reduce_op(op, average)
    handle = ddl.allreduce_async(tensor.detach(), name=name, op=op,
                                 prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set)
    return _InPlace(handle, tensor)


@_takes_tensors
def grouped_allreduce(tensors, average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Compressor = Compression.none,
                      op: Optional[ReduceOp] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set):
    """Allreduce a list of tensors as one fused group; a list of new tensors.
    Differentiable (Sum and Average) when a tensor requires a gradient."""
    op = client_reduce_op(op, average)
    wires = [compression.compress(t) for t in tensors]
    sent = [w for w, _ in wires]
    if any(_needs_grad(w) for w in sent):
        outs = _autograd.GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                       process_set, *sent)
    else:
        outs = ddl.grouped_allreduce([w.detach() for w in sent], name=name, op=op,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor,
                                     process_set=process_set)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wires)]


@_takes_tensors
def grouped_allreduce_async(tensors, average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`grouped_allreduce`; the handle's result is a list."""
    return ddl.grouped_allreduce_async([t.detach() for t in tensors], name=name,
                                       op=client_reduce_op(op, average),
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor,
                                       process_set=process_set)


@_takes_tensors
def grouped_allreduce_(tensors, average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    """In-place :func:`grouped_allreduce`: each tensor receives its result; returns the
    list of the same tensors."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, process_set).wait()


@_takes_tensors
def grouped_allreduce_async_(tensors, average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> _InPlace:
    """Asynchronous in-place grouped allreduce: ``synchronize(handle)`` writes each result
    into its tensor and returns the list. Do not use the tensors until then."""
    tensors = list(tensors)
    return _InPlace(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                            postscale_factor, process_set), tensors)


# -- allgather ------------------------------------------------------------------------------

@_takes_tensors
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along dim 0, in rank order (dims after the
    first must agree). Differentiable when ``tensor`` requires a gradient."""
    if _needs_grad(tensor):
        return _autograd.Allgather.apply(tensor, name, process_set)
    return ddl.allgather(tensor, name=name, process_set=process_set)


@_takes_tensors
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`allgather` (not differentiable)."""
    return ddl.allgather_async(tensor.detach(), name=name, process_set=process_set)


# -- broadcast ------------------------------------------------------------------------------

@_takes_tensors
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A copy of ``root_rank``'s ``tensor`` on every member; a new tensor.
    Differentiable when ``tensor`` requires a gradient."""
    if _needs_grad(tensor):
        return _autograd.Broadcast.apply(tensor, root_rank, name, process_set)
    return ddl.broadcast(tensor, root_rank, name=name, process_set=process_set)


@_takes_tensors
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`broadcast` (not differentiable)."""
    return ddl.broadcast_async(tensor.detach(), root_rank, name=name, process_set=process_set)


@_takes_tensors
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast`: ``tensor`` receives root's values and is returned."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


@_takes_tensors
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> _InPlace:
    """Asynchronous in-place broadcast; ``synchronize(handle)`` fills ``tensor``."""
    handle = ddl.broadcast_async(tensor.detach(), root_rank, name=name,
                                 process_set=process_set)
    return _InPlace(handle, tensor)


# -- the rest -------------------------------------------------------------------------------

@_takes_tensors
def alltoall(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Rows of ``tensor`` to every member (see :func:`ddl.alltoall`): the received rows,
    and with ``splits`` given also how many came from each member, ``(received,
    received_splits)`` (a tensor), as Horovod's. Differentiable when ``tensor`` requires
    a gradient (each row's gradient goes back to the member that sent it)."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if _needs_grad(tensor):
        out, received = _autograd.Alltoall.apply(tensor, splits, name, process_set)
    else:
        out, received = ddl.alltoall(tensor, splits=splits, name=name,
                                     process_set=process_set)
        received = torch.from_numpy(np.asarray(received))
    return out if splits is None else (out, received)


@_takes_tensors
def alltoall_async(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`alltoall`; the handle's result is ``(received, splits)`` with
    the splits as a NumPy array."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    return ddl.alltoall_async(tensor.detach(), splits=splits, name=name,
                              process_set=process_set)


@_takes_tensors
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: Optional[ReduceOp] = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> ddl.Handle:
    """Asynchronous :func:`reducescatter`."""
    return ddl.reducescatter_async(tensor.detach(), name=name,
                                   op=Average if op is None else op, process_set=process_set,
                                   prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor)


@_takes_tensors
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Compressor = Compression.none, op: Optional[ReduceOp] = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce across members, then member i keeps block i of dim 0 (default Average).
    ``compression`` casts the tensor for the wire and back (``Compression.fp16``).
    Differentiable (Sum and Average) when ``tensor`` requires a gradient."""
    return _reducescatter([tensor], compression, False, name=name,
                          op=Average if op is None else op, process_set=process_set,
                          prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)[0]


@_takes_tensors
def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather a list of tensors as one group (one negotiation); a list of tensors.
    Differentiable as :func:`allgather` when a tensor requires a gradient (the gradients
    averaged in one grouped allreduce)."""
    tensors = list(tensors)
    if not any(t.requires_grad for t in tensors):
        return ddl.grouped_allgather([t.detach() for t in tensors], name=name,
                                     process_set=process_set)
    return list(_autograd.GroupedAllgather.apply(name, process_set, *tensors))


@_takes_tensors
def grouped_reducescatter(tensors, name: Optional[str] = None,
                          compression: Compressor = Compression.none,
                          op: Optional[ReduceOp] = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Reduce-scatter a list of tensors as one group (default Average); a list of tensors.
    ``compression`` casts them for the wire and back. Differentiable (Sum and Average)
    when a tensor requires a gradient."""
    return _reducescatter(tensors, compression, True, name=name,
                          op=Average if op is None else op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def _reducescatter(tensors, compression: Compressor, grouped: bool, **kwargs) -> list:
    wires = [compression.compress(t) for t in tensors]
    sent = [w for w, _ in wires]
    outs = (_autograd.Reducescatter.apply(grouped, kwargs, *sent) if any(map(_needs_grad, sent))
            else _autograd.reducescatter_detached(sent, grouped, kwargs))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wires)]


@_takes_tensors
def grouped_allgather_async(tensors, name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> ddl.Handle:
    """Asynchronous :func:`grouped_allgather`; the handle's result is a list."""
    return ddl.grouped_allgather_async([t.detach() for t in tensors], name=name,
                                       process_set=process_set)


@_takes_tensors
def grouped_reducescatter_async(tensors, name: Optional[str] = None,
                                op: Optional[ReduceOp] = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> ddl.Handle:
    """Asynchronous :func:`grouped_reducescatter`; the handle's result is a list."""
    return ddl.grouped_reducescatter_async([t.detach() for t in tensors], name=name,
                                           op=Average if op is None else op,
                                           process_set=process_set,
                                           prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor)


# -- sparse tensors -------------------------------------------------------------------------

class _SparseAllreduce:
    """A sparse tensor's reduction in flight: every member's indices and values, gathered
    (``wait()`` returns the coalesced sum, divided by the members for Average). Calling
    the handle waits too, as Horovod's ``sparse_allreduce_async`` handle is called."""

    def __init__(self, tensor: torch.Tensor, name: Optional[str], op: ReduceOp,
                 process_set: ProcessSet):
        if op not in (Sum, Average):
            raise ValueError(f"sparse_allreduce_async {name!r}: op must be Sum or Average, "
                             f"not {op.name}; densify the tensor (tensor.to_dense()) for "
                             f"other reductions")
        tensor = tensor.coalesce()
        self._shape, self._name = tensor.shape, name
        self._divide = process_set.size() if op == Average else 1
        self._ranks = process_set.ranks or tuple(range(ddl.size()))
        # one grouped allgather (SPARSE_PARTS), which fails as a whole: the dense shape
        # travels too (the leader compares the gathered parts' trailing dims only, and
        # rows past another member's shape would make a broken tensor), under the call's
        # own name, so that a dense allreduce of that name on another member meets it (an
        # op mismatch, at once) rather than waiting for it
        shape, indices, values = (np.array([tensor.shape], np.int64),
                                  tensor.indices().t().contiguous(),
                                  tensor.values().contiguous())
        self._handle = ddl.allgather_async(dict(zip(SPARSE_PARTS, (shape, indices, values))),
                                           name=name, process_set=process_set)

    def poll(self) -> bool:
        return self._handle.poll()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        out = self._handle.wait(timeout)
        shapes, indices, values = (out[k] for k in SPARSE_PARTS)
        check_rows_agree(shapes, "sparse tensor shape", "allreduce", self._name,
                         self._ranks, "every member passes a sparse tensor of one shape")
        return torch.sparse_coo_tensor(indices.t(), values / self._divide, self._shape,
                                       check_invariants=True).coalesce()

    def __call__(self) -> torch.Tensor:
        return self.wait()


@_takes_tensors
def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None,
                           op: Optional[ReduceOp] = None,
                           process_set: ProcessSet = global_process_set) -> _SparseAllreduce:
    """Asynchronous allreduce of a sparse COO tensor (default Average): every member's
    indices and values are allgathered (their counts may differ between members) and
    ``synchronize(handle)`` (or ``handle()``, as Horovod's) returns the coalesced sparse
    result. Every member passes a sparse tensor of the same shape and dtype; Sum and
    Average only."""
    if not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async {name!r}: takes a sparse COO tensor, not "
                         f"a {tensor.layout} one; use allreduce_async for dense tensors")
    return _SparseAllreduce(tensor.detach(), name, Average if op is None else ReduceOp(op),
                            process_set)


def join(device: int = -1, timeout: Optional[float] = None,
         process_set: ProcessSet = global_process_set) -> int:
    """:func:`ddl.join` with Horovod's torch signature: say this rank has no more data,
    return once every member joined, with the last member to join. ``device`` (where
    Horovod makes its zero tensors) changes nothing: ddl makes the neutral values where
    each collective's arrays are."""
    del device
    return ddl.join(timeout, process_set)


def synchronize(handle: Any, timeout: Optional[float] = None) -> Any:
    """Wait for an asynchronous call's handle and return its result."""
    return handle.wait(timeout)


def poll(handle: Any) -> bool:
    """Whether the handle's collective finished; never blocks."""
    return handle.poll()
