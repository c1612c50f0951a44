"""Collectives as TensorFlow operations: eager, inside ``tf.function``, in v1 graphs.

Each collective is a ``tf.numpy_function`` op around the core collective, so the same
call works eagerly, traced into a ``tf.function``, and in a ``tf.compat.v1`` graph run
by a Session; ``allreduce``, ``allgather`` and ``broadcast`` carry gradients (the
gradient of an allreduce is the same allreduce of the incoming gradient; of an
allgather, the members' average gradient, this rank's rows of it; of a broadcast, the
average gradient on the root and zero elsewhere: Horovod's TensorFlow gradients, which
average where its torch ones sum).

The signatures are Horovod's, positions included. ``device_dense``, ``device_sparse`` and
``ignore_name_scope`` are accepted and change nothing: every collective runs on the host
(a device tensor is copied there and back by TensorFlow), and op names come from the
collective's name. ``compression`` (``Compression.fp16``) casts for the wire and back.

Cross-rank contract: as for :mod:`ddl` (same names, dtypes, shapes on every member).
A name is fixed when the op is built: eagerly, an unnamed call takes the next automatic
name; in a graph, every unnamed op gets ``<op>.tf.<n>`` in the order the program builds
them (so every rank must build its graph the same way), and keeps it for every run.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util as _control_flow_util

import ddl
from ddl import ProcessSet, ReduceOp, global_process_set
from ddl._client_api import (Compressor, check_rows_agree, client_reduce_op, recording,
                             refuse)

from ddl.tensorflow._compression import Compression

Average, Sum = ReduceOp.Average, ReduceOp.Sum
_graph_names = itertools.count()
_lock = threading.Lock()


class _Order(threading.local):
    """The collective ops built inside :func:`in_order` in this thread, last one first."""

    last = None
    depth = 0


_order = _Order()


@contextlib.contextmanager
def in_order():
    """In a ``tf.compat.v1`` graph, make the collectives built inside this block run one
    after the other, in the order they were built (a chain of control dependencies).

    A Session runs independent ops at once, in any order, on a small thread pool; several
    blocking collectives fetched in one ``session.run`` could then hold every thread while
    their partners wait behind them on another rank. Build several collectives that run
    in one step inside this block (``DistributedOptimizer``, ``broadcast_variables`` and
    ``broadcast_global_variables`` do it for theirs). Not needed eagerly or inside a
    ``tf.function``, which already runs stateful ops in program order.
    """
    _order.depth += 1
    try:
        yield
    finally:
        _order.depth -= 1
        if _order.depth == 0:
            _order.last = None


def _refuse_xla(name: str) -> None:
    """Raise, while a function is traced for XLA (``tf.function(jit_compile=True)``), that
    ``name``, a host callback, cannot be compiled there: at trace time, on every rank,
    saying what to do (XLA would refuse the graph later with a message about PyFunc)."""
    if not tf.executing_eagerly() and _control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"{name}: ddl's TensorFlow collectives run on the host (tf.numpy_function), "
            f"which XLA cannot compile, and this function is compiled with XLA "
            f"(tf.function(jit_compile=True)): call them outside it, e.g. compile the "
            f"forward and backward pass and reduce the gradients in a plain tf.function "
            f"(Keras: model.compile(..., jit_compile=False))")


def _numpy_op(fn, inputs, dtypes, name: str):
    """``tf.numpy_function`` for a blocking collective (chained inside :func:`in_order`)."""
    _refuse_xla(name)
    fn = recording(fn)  # a graph turns ddl's errors into tf.errors: see ddl.tensorflow.elastic
    if tf.executing_eagerly() or not _order.depth:
        return tf.numpy_function(fn, inputs, dtypes, stateful=True, name=name)
    previous = _order.last
    with tf.control_dependencies([previous] if previous is not None else []):
        out = tf.numpy_function(fn, inputs, dtypes, stateful=True, name=name)
    _order.last = (out[0] if isinstance(out, (list, tuple)) else out).op
    return out


def _name(op: str, name: Optional[str]) -> Optional[str]:
    """``name``, or in graph building a fixed automatic one (see the module doc)."""
    if name is not None or tf.executing_eagerly():
        return name
    with _lock:
        return f"{op}.tf.{next(_graph_names)}"


def _op_name(name: Optional[str], op: str) -> str:
    """A TensorFlow op name (letters, digits, ``._-/``) derived from a collective name."""
    base = f"ddl_{op}" if name is None else f"ddl_{op}_{name}"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in base)[:200]


def _tensor(value, fn: str, name: Optional[str], process_set: ProcessSet,
            group: int = 0) -> tf.Tensor:
    """``tf.convert_to_tensor(value)``; what it cannot convert fails the call on every
    member at once, not on this rank alone (:func:`ddl._client_api.refuse`), when the
    call is named (the others' unnamed call may be several collectives: a sparse one)."""
    try:
        return tf.convert_to_tensor(value)
    except (TypeError, ValueError) as exc:
        if name is None:
            raise
        refuse(fn.replace("grouped_", ""),
               f"passed {type(value).__name__} to ddl.tensorflow.{fn}, which takes tensors "
               f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
               exc, name=name, process_set=process_set, group=group)


def _as_numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else np.asarray(x)


# -- allreduce ------------------------------------------------------------------------------

def _allreduce_op(tensor, name, op, prescale, postscale, process_set):
    def run(x):
        return np.asarray(ddl.allreduce(_as_numpy(x), name=name, op=op,
                                        prescale_factor=prescale,
                                        postscale_factor=postscale,
                                        process_set=process_set), dtype=x.dtype)
    out = _numpy_op(run, [tensor], tensor.dtype,
                    name=_op_name(name, "allreduce"))
    out.set_shape(tensor.shape)
    return out


def allreduce(tensor, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: Compressor = Compression.none,
              op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Reduce ``tensor`` across the process set (default ``Average``); differentiable
    for Sum and Average. A ``tf.IndexedSlices`` (a sparse gradient) gives one, as in
    Horovod: every member's values and indices gathered (values divided by the members
    for Average; Sum and Average only)."""
    op = client_reduce_op(op, average)
    name = _name("allreduce", name)
    if isinstance(tensor, tf.IndexedSlices):
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise SparseAllreduceError(
                f"allreduce {name!r} of a tf.IndexedSlices: prescale_factor and "
                f"postscale_factor are not supported (got {prescale_factor}, "
                f"{postscale_factor}); scale the values, or pass "
                f"tf.convert_to_tensor(slices) to reduce it densely")
        return sparse_allreduce(tensor, name, op, process_set)
    tensor, ctx = compression.compress(_tensor(tensor, "allreduce", name, process_set))

    @tf.custom_gradient
    def fn(x):
        y = _allreduce_op(x, name, op, prescale_factor, postscale_factor, process_set)

        def grad(dy):
            if op not in (Sum, Average):
                raise NotImplementedError(f"the gradient of an allreduce with {op.name} "
                                          f"is not defined (only Sum and Average)")
            return _allreduce_op(tf.convert_to_tensor(dy), _grad(name), op,
                                 prescale_factor, postscale_factor, process_set)
        return y, grad

    return compression.decompress(fn(tensor), ctx)


class SparseAllreduceError(ValueError, NotImplementedError):
    """An allreduce of a ``tf.IndexedSlices`` that ddl does not do: an op other than Sum
    or Average, or a scale factor. Raised on the calling rank before anything is sent
    (every member passes the same arguments, so every member raises it). A
    ``ValueError``, and also the ``NotImplementedError`` Horovod raises there."""


def sparse_allreduce(slices: tf.IndexedSlices, name: Optional[str], op: ReduceOp,
                     process_set: ProcessSet) -> tf.IndexedSlices:
    """The allreduce of a ``tf.IndexedSlices`` (see :func:`allreduce`)."""
    if op not in (Sum, Average):
        raise SparseAllreduceError(f"allreduce {name!r} of a tf.IndexedSlices: op must be "
                                   f"Sum or Average, not {op.name}; pass "
                                   f"tf.convert_to_tensor(slices) to reduce it densely")
    part = (lambda what: None) if name is None else (lambda what: f"{name}/{what}")
    # the dense shape travels too: the leader compares the gathered parts' trailing dims
    # only, and rows past another member's shape would break the result. Slices without
    # one (Horovod takes them, and gives back slices without one) send -1 for dim 0, the
    # same number of calls on every member; dim 0 is then not compared.
    dense = slices.dense_shape
    if dense is None:
        dense = tf.concat([[-1], tf.shape(slices.values, out_type=tf.int64)[1:]], 0)
    # under the call's own name: a dense allreduce of that name on another member meets
    # it (an op mismatch, at once) rather than waiting for it
    shapes = allgather(tf.reshape(tf.cast(dense, tf.int64), [1, -1]), name=name,
                       process_set=process_set)
    values = allgather(slices.values, name=part("values"), process_set=process_set)
    indices = allgather(slices.indices, name=part("indices"), process_set=process_set)
    ranks = process_set.ranks or tuple(range(ddl.size()))

    def check(rows):
        rows = np.asarray(rows)
        if rows.ndim == 2 and rows.shape[1] and (rows[:, 0] < 0).any():
            rows = rows[:, 1:]      # a member without dense_shape: its rows are unknown
        if rows.size:
            check_rows_agree(rows, what="IndexedSlices dense_shape", op="allreduce",
                             name=name, ranks=ranks,
                             hint="every member passes slices of one dense shape")
    if tf.executing_eagerly():
        check(shapes.numpy())
    else:   # in a graph: checked when it runs (a TF error that carries the message)
        checked = tf.numpy_function(lambda rows: (check(rows), rows)[1], [shapes], tf.int64)
        with tf.control_dependencies([checked]):
            values = tf.identity(values)
    if op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _grad(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}/grad"


def grouped_allreduce(tensors, average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: Compressor = Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      name: Optional[str] = None, ignore_name_scope: bool = False) -> list:
    """Allreduce a list of tensors as one fused group (one op); differentiable for Sum
    and Average (the gradient is the same grouped allreduce of the incoming gradients).
    ``tf.IndexedSlices`` in the list are reduced as :func:`allreduce` reduces them (their
    values and indices gathered, Sum or Average, no scale factors), each under
    ``<name>/<position>``, and come back as slices, as Horovod's do; the dense ones go
    as one group under ``<name>/dense``."""
    op = client_reduce_op(op, average)
    name = _name("grouped_allreduce", name)
    tensors = list(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        if op not in (Sum, Average):   # before any collective, the dense part's too
            raise SparseAllreduceError(
                f"grouped_allreduce {name!r} of tf.IndexedSlices: op must be Sum or Average, "
                f"not {op.name}; pass dense tensors (tf.convert_to_tensor) to reduce them so")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise SparseAllreduceError(
                f"grouped_allreduce {name!r} of tf.IndexedSlices: prescale_factor and "
                f"postscale_factor are not supported (got {prescale_factor}, "
                f"{postscale_factor}); scale the values, or pass dense tensors")
        part = (lambda what: None) if name is None else (lambda what: f"{name}/{what}")
        out = list(tensors)
        dense = [i for i in range(len(tensors)) if i not in sparse]
        if dense:
            reduced = grouped_allreduce([tensors[i] for i in dense], compression=compression,
                                        op=op, process_set=process_set, name=part("dense"))
            for i, r in zip(dense, reduced):
                out[i] = r
        for i in sparse:
            out[i] = sparse_allreduce(tensors[i], part(i), op, process_set)
        return out
    if not tensors:
        return []

    def reduce(xs, called):
        kwargs = dict(name=called, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, process_set=process_set)
        return _grouped_op(xs, compression, "grouped_allreduce", called,
                           lambda arrays: ddl.grouped_allreduce(arrays, **kwargs),
                           rows_known=True, process_set=process_set)

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):  # the same grouped allreduce of the incoming gradients
            if op not in (Sum, Average):
                raise NotImplementedError(f"the gradient of a grouped_allreduce with "
                                          f"{op.name} is not defined (only Sum and Average)")
            return reduce([tf.convert_to_tensor(d) for d in dys], _grad(name))
        return reduce(list(xs), name), grad

    return list(fn(*tensors))


def _grouped_op(tensors, compression: Compressor, what: str, name: Optional[str], call,
                rows_known: bool, process_set: ProcessSet) -> list:
    """One op running ``call`` (a list of arrays to a list of results, in their order) on
    ``tensors``, compressed for the wire; each result has its input's dtype, and its
    shape, or (``rows_known`` False) its shape after dim 0."""
    tensors = list(tensors)
    group = len(tensors) if what.startswith("grouped_") else 0
    wires = [compression.compress(_tensor(t, what, name, process_set, group))
             for t in tensors]
    if not wires:
        return []

    def run(*xs):
        outs = call([_as_numpy(x) for x in xs])
        return [np.asarray(o, dtype=x.dtype) for o, x in zip(outs, xs)]
    outs = _numpy_op(run, [w for w, _ in wires], [w.dtype for w, _ in wires],
                     name=_op_name(name, what))
    outs = outs if isinstance(outs, (list, tuple)) else [outs]  # one comes back bare
    for o, (w, _) in zip(outs, wires):
        o.set_shape(w.shape if rows_known else
                    tf.TensorShape([None]).concatenate(w.shape[1:]))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, wires)]


# -- allgather ------------------------------------------------------------------------------

def _allgather_op(tensor, name, process_set):
    def run(x):
        return np.asarray(ddl.allgather(_as_numpy(x), name=name, process_set=process_set),
                          dtype=x.dtype)
    out = _numpy_op(run, [tensor], tensor.dtype,
                    name=_op_name(name, "allgather"))
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every member's ``tensor`` concatenated along dim 0 in rank order; differentiable
    (the gradient is this rank's rows of the members' average incoming gradient, as
    Horovod's TensorFlow allgather)."""
    name = _name("allgather", name)
    tensor = _tensor(tensor, "allgather", name, process_set)

    @tf.custom_gradient
    def fn(x):
        y = _allgather_op(x, name, process_set)

        def grad(dy):
            rows = _allgather_op(tf.shape(x, out_type=tf.int64)[:1],
                                 None if name is None else f"{name}/rows", process_set)
            total = _allreduce_op(tf.convert_to_tensor(dy), _grad(name), Average, 1.0, 1.0,
                                  process_set)
            me = process_set.rank()
            start = tf.reduce_sum(rows[:me])
            return total[start:start + rows[me]]
        return y, grad

    return fn(tensor)


# -- broadcast ------------------------------------------------------------------------------

def _broadcast_op(tensor, root_rank, name, process_set):
    def run(x):
        return np.asarray(ddl.broadcast(_as_numpy(x), root_rank, name=name,
                                        process_set=process_set), dtype=x.dtype)
    out = _numpy_op(run, [tensor], tensor.dtype,
                    name=_op_name(name, "broadcast"))
    out.set_shape(tensor.shape)
    return out


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every member; differentiable (the gradient is the
    members' average incoming gradient on the root, zero elsewhere, as Horovod's
    TensorFlow broadcast)."""
    name = _name("broadcast", name)
    tensor = _tensor(tensor, "broadcast", name, process_set)

    @tf.custom_gradient
    def fn(x):
        y = _broadcast_op(x, root_rank, name, process_set)

        def grad(dy):
            total = _allreduce_op(tf.convert_to_tensor(dy), _grad(name), Average, 1.0, 1.0,
                                  process_set)
            if ddl.rank() == root_rank:
                return total
            with tf.control_dependencies([total]):  # zeros need only the shape: a v1
                return tf.zeros_like(total)          # session would prune the allreduce
        return y, grad

    return fn(tensor)


# -- the rest -------------------------------------------------------------------------------

def _alltoall_op(tensor, splits, name, process_set):
    """``(received, received_splits)`` of one alltoall op (``splits`` a tensor or None)."""
    def run(x, s=None):
        out, got = ddl.alltoall(_as_numpy(x), splits=None if s is None else s.tolist(),
                                name=name, process_set=process_set)
        return np.asarray(out, dtype=x.dtype), np.asarray(got, dtype=np.int64)
    inputs = [tensor] if splits is None else [tensor, splits]
    out, got = _numpy_op(run, inputs, [tensor.dtype, tf.int64],
                         name=_op_name(name, "alltoall"))
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out, got


def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set):
    """Rows of ``tensor`` to every member: the received rows, and with ``splits`` given
    also how many came from each member, ``(received, received_splits)``, as Horovod's.
    Differentiable: each row's gradient goes back to the member that sent it."""
    name = _name("alltoall", name)
    tensor = _tensor(tensor, "alltoall", name, process_set)
    # any integer dtype (Horovod's op takes int32 splits)
    given = None if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int64)

    @tf.custom_gradient
    def fn(x):
        out, got = _alltoall_op(x, given, name, process_set)

        def grad(dy, _=None):
            back, _ = _alltoall_op(tf.convert_to_tensor(dy), got, _grad(name), process_set)
            return back
        return (out, got), grad

    out, got = fn(tensor)
    return out if splits is None else (out, tf.cast(got, tf.int32))  # int32, as Horovod's


def reducescatter(tensor, device_dense: str = "", compression: Compressor = Compression.none,
                  op: Optional[ReduceOp] = None, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce across members (default Average); member i keeps block i of dim 0.
    Differentiable as Horovod's TensorFlow op: the gradient is the members' incoming
    gradients gathered (times the members' number for Sum)."""
    name = _name("reducescatter", name)
    op = Average if op is None else ReduceOp(op)
    kwargs = dict(name=name, op=op, process_set=process_set,
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            return _scatter_grads([dy], op, name, process_set)[0]
        return _grouped_op([x], compression, "reducescatter", name,
                           lambda xs: [ddl.reducescatter(xs[0], **kwargs)],
                           rows_known=False, process_set=process_set)[0], grad

    return fn(tensor)


def _scatter_grads(dys, op: ReduceOp, name: Optional[str], process_set: ProcessSet) -> list:
    """The gradients of a (grouped) reduce-scatter, as Horovod's TensorFlow ops make
    them: the incoming gradients gathered in one group, times the members' number for
    Sum (Horovod's convention)."""
    if op not in (Sum, Average):
        raise NotImplementedError(f"the gradient of a reducescatter with {op.name} is not "
                                  f"defined (only Sum and Average)")
    dys = [tf.convert_to_tensor(d) for d in dys]
    if op == Sum:
        dys = [d * tf.cast(process_set.size(), d.dtype) for d in dys]
    return grouped_allgather(dys, name=_grad(name), process_set=process_set)


def grouped_reducescatter(tensors, device_dense: str = "",
                          compression: Compressor = Compression.none,
                          op: Optional[ReduceOp] = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None, ignore_name_scope: bool = False) -> list:
    """Reduce-scatter a list of tensors as one group (default Average; one op, one
    negotiation); a list of tensors, each this member's block of dim 0. Differentiable
    as :func:`reducescatter`."""
    name = _name("grouped_reducescatter", name)
    op = Average if op is None else ReduceOp(op)
    kwargs = dict(name=name, op=op, process_set=process_set,
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    tensors = list(tensors)
    if not tensors:
        return []

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            return _scatter_grads(dys, op, name, process_set)
        return _grouped_op(list(xs), compression, "grouped_reducescatter", name,
                           lambda arrays: ddl.grouped_reducescatter(arrays, **kwargs),
                           rows_known=False, process_set=process_set), grad

    return list(fn(*tensors))


def grouped_allgather(tensors, name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather a list of tensors as one group (one op, one negotiation); a list of
    tensors. Differentiable as :func:`allgather`: each gradient is this rank's rows of
    the members' average incoming gradient (one grouped allreduce for all of them)."""
    name = _name("grouped_allgather", name)
    tensors = list(tensors)
    if not tensors:
        return []

    def gather(xs, called):
        return _grouped_op(xs, Compression.none, "grouped_allgather", called,
                           lambda arrays: ddl.grouped_allgather(arrays, name=called,
                                                                process_set=process_set),
                           rows_known=False, process_set=process_set)

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            counts = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])
            rows = _allgather_op(tf.reshape(counts, [1, -1]),
                                 None if name is None else f"{name}/rows", process_set)
            totals = grouped_allreduce([tf.convert_to_tensor(d) for d in dys], op=Average,
                                       process_set=process_set, name=_grad(name))
            me = process_set.rank()
            starts = tf.reduce_sum(rows[:me], axis=0)
            return [t[starts[i]:starts[i] + rows[me, i]] for i, t in enumerate(totals)]
        return gather(list(xs), name), grad

    return list(fn(*tensors))


def broadcast_object(obj, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set):
    """:func:`ddl.broadcast_object` with Horovod's TensorFlow signature (``session`` is
    accepted and not needed: the object never goes through the graph)."""
    del session
    return ddl.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """:func:`ddl.allgather_object` with Horovod's TensorFlow signature (``session``
    accepted and not needed)."""
    del session
    return ddl.allgather_object(obj, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set):
    """A function ``fn(obj)`` that returns ``root_rank``'s ``obj`` on every member, as
    :func:`ddl.broadcast_object` does (Horovod's form for v1 graph code; ``session`` is
    accepted and not needed: the object never goes through the graph)."""
    del session

    def broadcast_obj(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return broadcast_obj
