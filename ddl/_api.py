"""The functional collectives.

Every collective here follows one contract:

* It is keyed by ``name``. Every member rank of the process set must make the call with
  the same name, op and parameters, and a compatible array (same dtype; same shape, or
  for ``allgather``/``alltoall`` the same shape after the first dimension). Ranks may
  submit different names in different orders: the leader orders them.
* If ``name`` is omitted, a name comes from a per-process counter (``allreduce.noname.N``),
  so every rank must then make its unnamed calls in the same order.
* The input is never modified. The result is a new array of the input's kind and dtype.
* A pytree (nested list/tuple/dict of arrays) is handled as one group and comes back
  with the same structure.
* Each collective has an ``_async`` twin returning a :class:`~ddl.Handle`.
* Every blocking call waits at most ``timeout`` seconds (default
  ``DDL_COLLECTIVE_TIMEOUT_SECONDS``), then raises :class:`~ddl.DDLTimeoutError`; the
  collective stays in flight (its name stays taken) until the job completes or fails it.
  A failure of the job (a lost peer or coordinator, a stall) raises at once instead.

One generic path does the work: ``_enqueue`` builds the requests, submits them, and
returns a handle; the public functions are thin wrappers.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ddl import _adapters, _dtypes, _pytree
from ddl._dtypes import ReduceOp
from ddl._engine import Entry
from ddl._handle import GroupHandle, Handle
from ddl._process_sets import ProcessSet, global_process_set, resolve
from ddl._runtime import runtime
from ddl.v1 import coordinator_pb2 as pb

Average = ReduceOp.Average


class _Blocking(threading.local):
    """Set while a blocking collective submits: its caller waits at once with the default
    timeout, so it may run a cached call's cycles itself (see ``Engine.submit``)."""

    on = False

    def __call__(self, timeout: Optional[float]) -> "_Blocking":
        self.on = timeout is None
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.on = False


_blocking = _Blocking()


def _check_name(name: Optional[str]) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, not {name!r}")


def _check_op(op: Any) -> ReduceOp:
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"op must be one of ddl.Sum, ddl.Average, ddl.Min, ddl.Max, "
                         f"ddl.Product, not {op!r}") from None


def _enqueue(op: int, x: Any, *, name: Optional[str], process_set: ProcessSet,
             reduce_op: int = 0, prescale: float = 1.0, postscale: float = 1.0,
             root_rank: int = 0, splits: Optional[Sequence[int]] = None,
             wrap: Optional[Callable[[Any, Any, Any], Any]] = None) -> Handle:
    """Submit one collective over ``x`` (an array, a pytree, or None) and return its handle.

    ``wrap(adapter, like, host_result)`` turns a leaf's host result into the user's value;
    by default the adapter rebuilds an array of ``like``'s kind.
    """
    rt = runtime()
    _check_name(name)
    ps_id, members = resolve(process_set, rt.topology.rank)
    opname = _dtypes.op_name(op)
    base = name if name is not None else rt.names.next(opname, ps_id)
    timeout = rt.config.collective_timeout

    if x is None:
        leaves, paths, treedef = [None], [""], None
    elif _pytree.is_tree(x):
        leaves, paths, treedef = _pytree.flatten(x)
    else:
        leaves, paths, treedef = [x], [""], None

    entries: List[Entry] = []
    for leaf, path in zip(leaves, paths):
        leaf_name = f"{base}/{path}" if path else base
        request = pb.Request(name=leaf_name, op=op, reduce_op=reduce_op,
                             prescale_factor=prescale, postscale_factor=postscale,
                             root_rank=root_rank, process_set_id=ps_id)
        array = None
        finish: Callable[[Any], Any] = lambda v: v
        if leaf is not None:
            adapter, array = _adapters.as_host_array(leaf)
            request.dtype = _dtypes.to_wire(array.dtype)
            request.shape.extend(int(d) for d in array.shape)
            if splits is not None:
                request.splits.extend(int(s) for s in splits)
            if wrap is not None:
                finish = (lambda a, lf: lambda v: wrap(a, lf, v))(adapter, leaf)
            else:
                finish = (lambda a, lf: lambda v: a.from_numpy(v, lf))(adapter, leaf)
        entries.append(Entry(request, array, Handle(opname, leaf_name, timeout), finish))

    drive = rt.engine.submit(entries, inline=_blocking.on)
    if treedef is None and len(entries) == 1:
        handle = entries[0].handle
    else:
        handle = GroupHandle(opname, base, timeout, [e.handle for e in entries],
                             lambda values: _pytree.unflatten(treedef, values))
    handle._drive = drive
    return handle


# -- allreduce -----------------------------------------------------------------------------

def allreduce_async(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`allreduce`; ``handle.wait()`` returns its result."""
    op = _check_op(op)
    return _enqueue(pb.ALLREDUCE, x, name=name, process_set=process_set, reduce_op=int(op),
                    prescale=float(prescale_factor), postscale=float(postscale_factor))


def allreduce(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set,
              timeout: Optional[float] = None) -> Any:
    """Reduce ``x`` elementwise across the ranks of ``process_set``; every rank gets the result.

    Every member must pass an array of the same dtype and shape under the same ``name``,
    with the same ``op`` and scale factors. The result is ``postscale * reduce(prescale *
    x)`` (``Average`` divides by the number of contributing ranks), a new array of ``x``'s
    kind and dtype; ``x`` is not modified. bfloat16 is reduced in float32; on bool only
    ``Min`` (and) and ``Max`` (or) are allowed.

    Example::

        ddl.init()
        total = ddl.allreduce(np.ones(3), name="ones", op=ddl.Sum)  # == ddl.size() * ones
    """
    with _blocking(timeout):
        handle = allreduce_async(x, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return handle.wait(timeout)


def grouped_allreduce_async(xs: Sequence[Any], name: Optional[str] = None,
                            op: ReduceOp = Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`grouped_allreduce`."""
    return allreduce_async(list(xs), name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce(xs: Sequence[Any], name: Optional[str] = None, op: ReduceOp = Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      timeout: Optional[float] = None) -> List[Any]:
    """Allreduce a list of arrays as one fused group; returns a list of results.

    Same contract as :func:`allreduce` for each element; every rank passes the same number
    of arrays, with matching dtypes and shapes position by position.
    """
    with _blocking(timeout):
        handle = grouped_allreduce_async(xs, name, op, prescale_factor,
                                         postscale_factor, process_set)
    return handle.wait(timeout)


# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------

def allgather_async(x: Any, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`allgather`."""
    return _enqueue(pb.ALLGATHER, x, name=name, process_set=process_set)


def allgather(x: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              timeout: Optional[float] = None) -> Any:
    """Concatenate every member's ``x`` along the first dimension, in rank order.

    Members must agree on the dtype and on every dimension but the first, which may differ
    per rank. ``x`` must have at least one dimension. Every rank gets the whole result.

    Example::

        rows = ddl.allgather(np.full((ddl.rank() + 1, 2), ddl.rank()), name="rows")
    """
    with _blocking(timeout):
        handle = allgather_async(x, name, process_set)
    return handle.wait(timeout)


def broadcast_async(x: Any, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`broadcast`."""
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"root_rank must be an int, not {type(root_rank).__name__}")
    size = runtime().topology.size
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"broadcast: root_rank {root_rank} is outside [0, {size})")
    return _enqueue(pb.BROADCAST, x, name=name, process_set=process_set,
                    root_rank=int(root_rank))


def broadcast(x: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              timeout: Optional[float] = None) -> Any:
    """Every member gets a copy of ``root_rank``'s ``x``.

    ``root_rank`` is a global rank and must be a member of ``process_set``. Every member
    passes an array of the same dtype and shape (non-roots' values are ignored).

    Example::

        weights = ddl.broadcast(weights, root_rank=0, name="init/w")
    """
    with _blocking(timeout):
        handle = broadcast_async(x, root_rank, name, process_set)
    return handle.wait(timeout)


def alltoall_async(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`alltoall`."""
    if _pytree.is_tree(x):
        raise TypeError("alltoall takes one array, not a pytree")
    if splits is not None:
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]

    def wrap(adapter, like, value):
        out, received = value
        return adapter.from_numpy(out, like), received

    return _enqueue(pb.ALLTOALL, x, name=name, process_set=process_set, splits=splits,
                    wrap=wrap)


def alltoall(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set, timeout: Optional[float] = None):
    """Send rows of ``x`` to every member; returns ``(received, received_splits)``.

    ``splits[j]`` rows (along dim 0, in order) go to the j-th member of the process set;
    without ``splits`` dim 0 is divided evenly. ``received`` concatenates what each member
    sent to this rank, in member order, and ``received_splits[j]`` is how many rows came
    from member j. Members agree on dtype and every dimension but the first.
    """
    with _blocking(timeout):
        handle = alltoall_async(x, splits, name, process_set)
    return handle.wait(timeout)


def reducescatter_async(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Asynchronous :func:`reducescatter`."""
    if _pytree.is_tree(x):
        raise TypeError("reducescatter takes one array, not a pytree")
    op = _check_op(op)
    return _enqueue(pb.REDUCESCATTER, x, name=name, process_set=process_set,
                    reduce_op=int(op), prescale=float(prescale_factor),
                    postscale=float(postscale_factor))


def reducescatter(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  timeout: Optional[float] = None) -> Any:
    """Reduce ``x`` across members, then member i keeps block i of dim 0.

    Dim 0 is split as evenly as possible; earlier members get one extra row when it does
    not divide. Members pass the same dtype and shape (at least one dimension).
    """
    with _blocking(timeout):
        handle = reducescatter_async(x, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return handle.wait(timeout)


def _enqueue_membership(op: int, ps: ProcessSet) -> Handle:
    """Submit an ADD/REMOVE_PROCESS_SET agreement among ``ps``'s members."""
    rt = runtime()
    opname = _dtypes.op_name(op)
    ranks = ",".join(str(r) for r in ps.ranks)
    if op == pb.ADD_PROCESS_SET:
        request = pb.Request(name=f"{opname}/{ranks}", op=op, process_set_id=0,
                             member_ranks=list(ps.ranks))
    else:
        request = pb.Request(name=f"{opname}/{ps.process_set_id}", op=op,
                             process_set_id=ps.process_set_id)
    handle = Handle(opname, request.name, rt.config.collective_timeout)
    rt.engine.submit([Entry(request, None, handle)])
    return handle


# -- synchronization -----------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set,
            timeout: Optional[float] = None) -> None:
    """Return once every member of ``process_set`` has called ``barrier``."""
    _enqueue(pb.BARRIER, None, name=None, process_set=process_set).wait(timeout)


def join(timeout: Optional[float] = None) -> int:
    """Say this rank has no more data; returns the last rank to join.

    Until every rank has joined, this rank keeps taking part in other ranks' allreduces
    and allgathers with neutral values (zero rows for allgather), and is not counted by
    ``Average``. Global process set only.
    """
    return _enqueue(pb.JOIN, None, name="join", process_set=global_process_set).wait(timeout)


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result (same as ``handle.wait()``)."""
    return handle.wait(timeout)


def poll(handle: Handle) -> bool:
    """Whether ``handle`` has finished; never blocks."""
    return handle.poll()
