"""Training helpers for JAX: an optax transformation that averages gradients across ranks,
and broadcasts of parameters and optimizer state (any pytree, flax ``nnx`` objects too).

Cross-rank contract: every rank builds the same transformation and calls ``update`` once
per step with gradients of the same structure, shapes and dtypes (the leader checks);
every rank calls the broadcasts with the same structure, in the same order.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any, Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddl import ProcessSet, ReduceOp, global_process_set
from ddl._client_api import CastCompressor, Compressor

from ddl.jax._compression import Compression
from ddl.jax._ops import allreduce, broadcast

Average = ReduceOp.Average


def fused_allreduce(tree: Any, name: str = "grads", op: ReduceOp = Average,
                    compression: Compressor = Compression.none,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce every leaf of ``tree`` in one collective: the leaves are cast to their
    wire dtype (``compression``'s for floating-point leaves, else the leaf's own),
    concatenated into one flat buffer per wire dtype, reduced in one grouped call, then
    cut, reshaped and cast back. Inside ``jax.jit`` the concatenation fuses into the step;
    the step runs one collective, whatever the number of leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    if any(isinstance(v, jax.core.Tracer) for v in leaves):
        # Inside jit, without the barrier XLA fuses the leaves' producers (the backward
        # pass's bias reductions and weight transposes) into the concatenation's loop,
        # where they run element by element: a small CNN's step took 1.9x as long
        leaves = list(jax.lax.optimization_barrier(leaves))
    wire = [_wire_dtype(v, compression) for v in leaves]
    order = sorted(set(wire), key=str)
    buffers = [jnp.concatenate([jnp.ravel(v).astype(d) for v, w in zip(leaves, wire)
                                if w == d]) for d in order]
    reduced = allreduce(buffers + [structure_mark(treedef, leaves)], name=name, op=op,
                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                        process_set=process_set)
    cursor = {d: 0 for d in order}
    out: List[Any] = []
    for v, w in zip(leaves, wire):
        buf, start = reduced[order.index(w)], cursor[w]
        cursor[w] = start + v.size
        out.append(buf[start:start + v.size].reshape(v.shape).astype(v.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def structure_mark(treedef: Any, leaves: List[Any]) -> Any:
    """A zero-size array whose shape ``(0, digest)`` is a digest of the tree's structure
    and its leaves' shapes and dtypes, sent last in the group of a call that flattens the
    tree: the leader compares shapes, so ranks whose trees differ (where the flat buffers
    alone could still match, and their elements be mixed) get a ``MismatchError`` naming
    that last member on every rank. It costs no bytes."""
    text = repr((str(treedef), [(tuple(jnp.shape(v)), str(jnp.result_type(v)))
                                for v in leaves]))
    return jnp.zeros((0, 1 + zlib.crc32(text.encode()) % (1 << 24)), jnp.float32)


def _wire_dtype(leaf: Any, compression: Compressor):
    dtype = jnp.asarray(leaf).dtype
    if isinstance(compression, CastCompressor) and jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(compression.wire_dtype)
    return dtype


def allreduce_gradients(op: ReduceOp = Average, compression: Compressor = Compression.none,
                        name: str = "grads", prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set
                        ) -> optax.GradientTransformation:
    """An optax transformation whose ``update`` reduces the gradients across the process
    set (default: their mean) with :func:`fused_allreduce`: one collective per step.
    Put it first in a chain (``DistributedOptimizer`` does); it keeps no state."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return fused_allreduce(updates, name=name, op=op, compression=compression,
                               prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor,
                               process_set=process_set), state

    return optax.GradientTransformation(init_fn, update_fn)


def DistributedOptimizer(optimizer: optax.GradientTransformation,
                         op: ReduceOp = Average, compression: Compressor = Compression.none,
                         name: str = "grads", prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set
                         ) -> optax.GradientTransformation:
    """``optimizer`` with the gradients averaged across ranks first (Horovod's
    ``DistributedOptimizer`` for optax): ``optax.chain(allreduce_gradients(...),
    optimizer)``. Accumulate over several micro-batches with
    ``optax.MultiSteps(DistributedOptimizer(tx), k)``: ranks then talk every k-th step."""
    return optax.chain(allreduce_gradients(op, compression, name, prescale_factor,
                                           postscale_factor, process_set), optimizer)


def broadcast_parameters(tree: Any, root_rank: int = 0, name: str = "parameters",
                         process_set: ProcessSet = global_process_set) -> Any:
    """``tree`` as ``root_rank`` has it, in one grouped broadcast: every array leaf (PRNG
    keys and unsigned 32/64-bit counters included, sent as their bits), and Python
    numbers (which come back as the same Python type); other leaves stay as they are. A
    flax ``nnx`` object (a Module, an ``nnx.Optimizer``) is updated in place with the
    root's state and returned; any other pytree comes back as a new one."""
    nnx = _nnx()
    if nnx is not None and nnx.graph.is_graph_node(tree):
        nnx.update(tree, broadcast_parameters(nnx.state(tree), root_rank, name,
                                              process_set))
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, v in enumerate(leaves) if _sendable(v)]
    if not picked:
        return tree
    wires, backs = zip(*(_as_wire(leaves[i]) for i in picked))
    got = broadcast(list(wires) + [structure_mark(treedef, list(wires))], root_rank,
                    name=name, process_set=process_set)
    out = list(leaves)
    for i, back, v in zip(picked, backs, got):
        out[i] = back(v)
    return jax.tree_util.tree_unflatten(treedef, out)


# unsigned integers the data plane has no dtype for (an nnx.Optimizer's step counter is a
# uint32) travel as the signed integers of the same width
_SAME_BITS = {np.dtype(np.uint32): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.int64)}


def _as_wire(leaf: Any) -> Tuple[Any, Callable[[Any], Any]]:
    """``(what to send, how to rebuild the leaf from what arrives)`` for one leaf: a type
    ddl's wire lacks travels as the signed integers of the same bits (a broadcast moves
    bits, so nothing changes); a Python number as a NumPy scalar."""
    if _python_number(leaf):
        kind = type(leaf)
        return np.asarray(leaf), lambda v: kind(np.asarray(v).item())
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(leaf)
        wire, back = _as_wire(jax.random.key_data(leaf))
        return wire, lambda v: jax.random.wrap_key_data(back(v), impl=impl)
    dtype = np.dtype(leaf.dtype)
    if dtype not in _SAME_BITS:
        return leaf, lambda v: v
    if isinstance(leaf, jax.Array):
        return (jax.lax.bitcast_convert_type(leaf, _SAME_BITS[dtype]),
                lambda v: jax.lax.bitcast_convert_type(v, dtype))
    return np.asarray(leaf).view(_SAME_BITS[dtype]), lambda v: np.asarray(v).view(dtype)


def broadcast_state(state: Any, root_rank: int = 0, name: str = "state",
                    process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast an optimizer state (or any pytree) from ``root_rank``; see
    :func:`broadcast_parameters`."""
    return broadcast_parameters(state, root_rank, name, process_set)


def _python_number(v: Any) -> bool:
    return isinstance(v, (bool, int, float)) and not isinstance(v, np.generic)


def _sendable(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray, np.generic)) or _python_number(v)


def _nnx() -> Optional[Any]:
    """flax.nnx if the program imported flax (ddl.jax never imports it itself)."""
    if "flax" not in sys.modules:
        return None
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - an old flax without nnx
        return None
    return nnx
