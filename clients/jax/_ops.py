"""Collectives on jax.Array: eager, inside ``jax.jit``/``grad``/``scan``, differentiable.

Cross-rank contract: as for the core collectives (:mod:`ddl`): every member of the process
set makes the same call under the same ``name`` with arrays of the same dtype and shape
(allgather and alltoall: the same shape after dim 0). Results are new ``jax.Array``s on
the input's device; inputs are never changed. A pytree (anything ``jax.tree_util``
flattens: dicts, lists, flax and optax states) goes as one group and comes back with the
same structure.

Two paths, one contract:

* **Concrete arrays** (no transformation): straight to the core collectives, the CPU
  buffers without copies (see :mod:`ddl.jax._adapter`).
* **Traced values** (``jax.jit``, ``grad``, ``value_and_grad``, ``scan``): the collective
  becomes an ordered ``io_callback`` in the compiled program. Ordered effects run in
  program order on each rank and XLA neither drops, duplicates nor reorders them, so a
  jitted step runs each collective exactly once per call and in the order it was written,
  which is what the leader's negotiation needs (it orders names across ranks, not within
  one). Result shapes must be known when tracing, so inside a transformation allgather
  and alltoall need the same dim 0 on every member (checked when the step runs: a
  :class:`ddl.MismatchError` on every member otherwise) and alltoall takes no ``splits``.
  ``vmap`` is refused with a TypeError (a batch of collectives is one collective on the
  batched array: call it outside ``vmap``).

Names: pass ``name=`` to every collective inside ``jit``. Without one, the name comes from
a per-process counter when the function is traced (``jax.allreduce.N``), so every rank
must then trace its functions in the same order, as for the core's unnamed calls.

Gradients (custom VJPs, through both paths): an allreduce's is the same allreduce of the
cotangent (Sum or Average, same scale factors; Min/Max/Product have none); an allgather's
is this rank's block of the Sum reduce-scatter of the cotangent; a broadcast's is the Sum
of the cotangents on the root and zero elsewhere; a reduce-scatter's is the allgather of
the cotangent (scaled as the forward); an alltoall's is the alltoall of the cotangent.
Backward collectives are named ``<name>/grad``: every rank must differentiate the same
calls.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import ddl
from ddl import MismatchError, NotInitializedError, ProcessSet, ReduceOp, global_process_set
from ddl._client_api import Compressor, client_reduce_op, recording, refuse

from ddl.jax._compression import Compression

Sum, Average = ReduceOp.Sum, ReduceOp.Average

try:  # the tracer of vmap (JAX exports no name for it; the check is a courtesy)
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover - depends on the JAX version
    _BatchTracer = None


@dataclasses.dataclass(frozen=True)
class _Call:
    """One collective's static part: what every execution of a traced call repeats."""

    kind: str                   # allreduce, allgather, broadcast, alltoall, reducescatter
    name: Optional[str]
    op: ReduceOp = Average
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = 0
    process_set: ProcessSet = global_process_set
    group: bool = False         # a pytree: its leaves go as one group (allreduce)

    def backward(self, kind: str, **changes: Any) -> "_Call":
        name = None if self.name is None else f"{self.name}/grad"
        return dataclasses.replace(self, kind=kind, name=name, **changes)


# -- names ----------------------------------------------------------------------------------

class _TraceNames(threading.local):
    counters: dict

    def __init__(self):
        self.counters = {}

    def next(self, kind: str) -> str:
        n = self.counters.get(kind, 0)
        self.counters[kind] = n + 1
        return f"jax.{kind}.{n}"


_trace_names = _TraceNames()


def _traced(leaves: Sequence[Any]) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def _static(fn: str, what: str, value: Any) -> Any:
    """``value`` if it is concrete; a TypeError naming it if it is a traced JAX value."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"ddl.jax.{fn}: {what} must be a concrete Python value, but it is traced by a "
            f"JAX transformation ({type(value).__name__}); every rank must know it when the "
            f"step is compiled: pass a Python number, or mark the argument static "
            f"(jax.jit(..., static_argnums=...))")
    return value


def _prepare(fn: str, x: Any, name: Optional[str],
             process_set: ProcessSet) -> Tuple[List[Any], Any, bool, str]:
    """``(leaves, treedef, traced, name)`` for a call of ``fn`` on ``x``; checks that the
    job is up and that no leaf is batched by vmap. ``x`` without arrays in a named call
    fails the others' call of the name at once too (:func:`ddl._client_api.refuse`)."""
    if not ddl.is_initialized():
        raise NotInitializedError(f"ddl.jax.{fn} was called before ddl.jax.init(): call "
                                  f"init() once in every process, before any collective")
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        got = f"{type(x).__name__} {x!r}"[:200]
        error = TypeError(f"ddl.jax.{fn}: got {got} with no arrays in it")
        if name is None:   # the others' name may be one of a trace (inside jit)
            raise error
        refuse(fn, f"passed {got}, which has no arrays in it, to ddl.jax.{fn}", error,
               name=_static(fn, "name", name), process_set=process_set)
    if _BatchTracer and any(isinstance(v, _BatchTracer) for v in leaves):
        raise TypeError(
            f"ddl.jax.{fn} cannot run under jax.vmap: a collective exchanges whole arrays "
            f"between processes, once per step; call it outside vmap, on the batched array "
            f"(one {fn} of the whole batch is what vmap would mean)")
    traced = _traced(leaves)
    _static(fn, "name", name)
    if traced and name is None:
        name = _trace_names.next(fn)
    return leaves, treedef, traced, name


# -- the host side: core collectives on NumPy arrays ------------------------------------------

def _core(call: _Call, xs: List[Any]) -> List[Any]:
    """Run ``call`` on ``xs`` (host or concrete jax arrays) with the core collectives."""
    kw = dict(name=call.name, process_set=call.process_set)
    if call.kind == "allreduce":
        scale = dict(op=call.op, prescale_factor=call.prescale,
                     postscale_factor=call.postscale)
        if call.group:
            return list(ddl.grouped_allreduce(xs, **kw, **scale))
        return [ddl.allreduce(xs[0], **kw, **scale)]
    if call.kind == "allgather":
        if call.group:
            return list(ddl.grouped_allgather(xs, **kw))
        return [ddl.allgather(xs[0], **kw)]
    if call.kind == "broadcast":
        if call.group:
            return list(ddl.broadcast(xs, call.root_rank, **kw))
        return [ddl.broadcast(xs[0], call.root_rank, **kw)]
    if call.kind == "reducescatter":
        scale = dict(op=call.op, prescale_factor=call.prescale,
                     postscale_factor=call.postscale)
        if call.group:
            return list(ddl.grouped_reducescatter(xs, **kw, **scale))
        return [ddl.reducescatter(xs[0], **kw, **scale)]
    if call.kind == "alltoall":
        return [ddl.alltoall(xs[0], **kw)[0]]
    raise AssertionError(call.kind)


def _result_avals(call: _Call, leaves: Sequence[Any]) -> List[jax.ShapeDtypeStruct]:
    """The shapes and dtypes ``call`` returns for ``leaves`` (known when tracing)."""
    out = []
    k, me = call.process_set.size(), call.process_set.rank()
    for x in leaves:
        shape = tuple(x.shape)
        if call.kind in ("allgather", "reducescatter", "alltoall") and not shape:
            raise TypeError(f"ddl.jax.{call.kind} '{call.name}': needs an array with at "
                            f"least one dimension, got a scalar")
        if call.kind == "allgather":
            shape = (k * shape[0],) + shape[1:]
        elif call.kind == "reducescatter":
            base, extra = divmod(shape[0], k)
            shape = (base + (1 if me < extra else 0),) + shape[1:]
        elif call.kind == "alltoall" and shape[0] % k:
            raise TypeError(f"ddl.jax.alltoall '{call.name}': inside a JAX transformation "
                            f"dim 0 ({shape[0]}) must divide evenly among the {k} members; "
                            f"call it outside jit for uneven splits")
        out.append(jax.ShapeDtypeStruct(shape, x.dtype))
    return out


def _host(call: _Call, avals: List[jax.ShapeDtypeStruct], *arrays: np.ndarray):
    """The callback a compiled step runs: the core collective, checked against the shapes
    the step was compiled for (the same on every member, else every member raises)."""
    outs = _core(call, [np.asarray(a) for a in arrays])
    results = []
    for out, aval in zip(outs, avals):
        out = np.asarray(out)
        if out.shape != aval.shape:
            raise MismatchError(
                f"{call.kind} '{call.name}' inside a JAX transformation: the result has "
                f"shape {list(out.shape)} on rank {ddl.rank()}, but the step was compiled "
                f"for {list(aval.shape)}, the same dim 0 on every member; ranks passed "
                f"different first dimensions: pad them to one size, or call "
                f"ddl.jax.{call.kind} outside jax.jit", op=call.kind, name=call.name or "")
        results.append(out)
    return tuple(results)


def _run(call: _Call, leaves: List[Any], traced: bool) -> List[Any]:
    """``call`` on ``leaves``: the core collectives for concrete arrays, an ordered
    ``io_callback`` for traced ones (and for any array while differentiating)."""
    if not traced:
        return _core(call, leaves)
    avals = _result_avals(call, leaves)
    outs = io_callback(recording(functools.partial(_host, call, avals)), tuple(avals),
                       *leaves, ordered=True)
    return list(outs)


# -- differentiation ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _differentiable(call: _Call):
    """``call`` as a function of a tuple of leaves, with its VJP."""

    @jax.custom_vjp
    def f(leaves):
        return tuple(_run(call, list(leaves), _traced(leaves)))

    def fwd(leaves):
        return tuple(_run(call, list(leaves), True)), None

    def bwd(_, cts):
        return (tuple(_vjp(call, list(cts))),)

    f.defvjp(fwd, bwd)
    return f


def _vjp(call: _Call, cts: List[Any]) -> List[Any]:
    """The cotangents of ``call``'s inputs from those of its outputs (see the module doc)."""
    k = call.process_set.size()
    if call.kind == "allreduce":
        if call.op not in (Sum, Average):
            raise TypeError(f"ddl.jax.allreduce '{call.name}': the gradient of an allreduce "
                            f"with {call.op.name} is not defined here (only Sum and Average)")
        return _run(call.backward("allreduce"), cts, True)
    if call.kind == "allgather":
        return _run(call.backward("reducescatter", op=Sum), cts, True)
    if call.kind == "broadcast":
        summed = _run(call.backward("allreduce", op=Sum), cts, True)
        if ddl.rank() == call.root_rank:
            return summed
        return [jnp.zeros_like(s) for s in summed]
    if call.kind == "reducescatter":
        scale = call.prescale * call.postscale / (k if call.op == Average else 1)
        if call.op not in (Sum, Average):
            raise TypeError(f"ddl.jax.reducescatter '{call.name}': the gradient of a "
                            f"reducescatter with {call.op.name} is not defined here (only "
                            f"Sum and Average)")
        gathered = _run(call.backward("allgather"), cts, True)
        return [g * jnp.asarray(scale, g.dtype) for g in gathered]
    if call.kind == "alltoall":
        return _run(call.backward("alltoall"), cts, True)
    raise AssertionError(call.kind)


def _apply(call: _Call, leaves: List[Any], traced: bool, treedef: Any) -> Any:
    """``call`` on ``leaves`` rebuilt as ``treedef``: concrete leaves (NumPy ones too, in
    their own dtypes) go straight to the core; traced ones through the custom VJP."""
    if traced:
        out = _differentiable(call)(tuple(leaves))
    else:
        out = _core(call, list(leaves))
    return jax.tree_util.tree_unflatten(treedef, list(out))


# -- the public collectives -------------------------------------------------------------------

def allreduce(x: Any, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Compressor = Compression.none, op: Optional[ReduceOp] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``x`` (an array or a pytree of arrays, one group) across the process set;
    default ``Average``. Works eagerly and inside ``jax.jit``; differentiable (Sum and
    Average). ``compression`` casts floating-point arrays for the wire and back.

    Example (inside a jitted step)::

        grads = ddl.jax.allreduce(grads, name="grads")
    """
    op = client_reduce_op(_static("allreduce", "op", op), average)
    leaves, treedef, traced, name = _prepare("allreduce", x, name, process_set)
    call = _Call("allreduce", name, op, _static("allreduce", "prescale_factor", prescale_factor),
                 _static("allreduce", "postscale_factor", postscale_factor),
                 process_set=process_set, group=not jax.tree_util.treedef_is_leaf(treedef))
    wire, ctxs = zip(*(compression.compress(v) for v in leaves))
    out = _apply(call, list(wire), traced, jax.tree_util.tree_structure(list(wire)))
    return jax.tree_util.tree_unflatten(
        treedef, [compression.decompress(v, c) for v, c in zip(out, ctxs)])


def grouped_allreduce(xs: Sequence[Any], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Compressor = Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[Any]:
    """Allreduce a list of arrays (or pytrees) as one group; a list of results."""
    return list(allreduce(list(xs), average, name, compression, op, prescale_factor,
                          postscale_factor, process_set))


def allgather(x: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every member's ``x`` (an array, or a pytree as one group) along dim 0,
    in member order. Eagerly, dim 0 may differ between members; inside a transformation it
    must be the same. Differentiable."""
    leaves, treedef, traced, name = _prepare("allgather", x, name, process_set)
    call = _Call("allgather", name, process_set=process_set,
                 group=not jax.tree_util.treedef_is_leaf(treedef))
    return _apply(call, leaves, traced, treedef)


def grouped_allgather(xs: Sequence[Any], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[Any]:
    """Allgather a list of arrays (or pytrees) as one group; a list of results."""
    return list(allgather(list(xs), name, process_set))


def broadcast(x: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``x`` (an array, or a pytree as one group) as the member with global rank
    ``root_rank`` has it. Differentiable: the root gets the Sum of every member's
    cotangent, the others zero."""
    leaves, treedef, traced, name = _prepare("broadcast", x, name, process_set)
    call = _Call("broadcast", name, root_rank=_static("broadcast", "root_rank", root_rank),
                 process_set=process_set, group=not jax.tree_util.treedef_is_leaf(treedef))
    return _apply(call, leaves, traced, treedef)


def alltoall(x: jax.Array, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Send rows of ``x`` to every member; returns ``(received, received_splits)`` as
    :func:`ddl.alltoall` does (``received_splits`` an int32 ``jax.Array``). Inside a
    transformation, ``splits`` must be None and dim 0 divide evenly. Differentiable."""
    leaves, treedef, traced, name = _prepare("alltoall", x, name, process_set)
    if len(leaves) != 1:
        raise TypeError("ddl.jax.alltoall takes one array, not a pytree")
    k = process_set.size()
    if traced:
        if splits is not None:
            raise TypeError(f"ddl.jax.alltoall '{name}': inside a JAX transformation the "
                            f"rows each rank receives must be known when tracing: pass no "
                            f"splits (dim 0 divided evenly), or call it outside jax.jit")
        out = _apply(_Call("alltoall", name, process_set=process_set), leaves, traced,
                     treedef)
        return out, jnp.full((k,), leaves[0].shape[0] // k, jnp.int32)
    if splits is not None and isinstance(splits, jax.Array):
        splits = np.asarray(splits).tolist()
    out, received = ddl.alltoall(leaves[0], splits=splits, name=name, process_set=process_set)
    return out, jnp.asarray(np.asarray(received, np.int32))


def reducescatter(x: Any, name: Optional[str] = None, op: Optional[ReduceOp] = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce ``x`` (an array, or a pytree as one group) across members (default Average),
    then member i keeps block i of dim 0 (earlier members get one extra row when it does
    not divide). Differentiable (Sum and Average, when dim 0 divides evenly)."""
    op = client_reduce_op(_static("reducescatter", "op", op), None)
    leaves, treedef, traced, name = _prepare("reducescatter", x, name, process_set)
    call = _Call("reducescatter", name, op,
                 _static("reducescatter", "prescale_factor", prescale_factor),
                 _static("reducescatter", "postscale_factor", postscale_factor),
                 process_set=process_set, group=not jax.tree_util.treedef_is_leaf(treedef))
    return _apply(call, leaves, traced, treedef)


def grouped_reducescatter(xs: Sequence[Any], name: Optional[str] = None,
                          op: Optional[ReduceOp] = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[Any]:
    """Reduce-scatter a list of arrays (or pytrees) as one group; a list of results."""
    return list(reducescatter(list(xs), name, op, process_set, prescale_factor,
                              postscale_factor))
