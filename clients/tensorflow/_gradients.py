"""Gradients reduced across ranks, what ``DistributedGradientTape`` and the two
optimizer wrappers (``DistributedOptimizer`` of TensorFlow v1 and of Keras) share: one
grouped allreduce per group; ``tf.IndexedSlices`` gradients are allgathered (values and
indices) unless ``sparse_as_dense=True`` or ``op=Adasum`` (which densifies them: its dot
products are over whole tensors). With ``op=Adasum`` the gradients are Adasum-combined per tensor
(:data:`ddl.Adasum`), as Horovod's TensorFlow Adasum does. Gradients of *local* variables
are not reduced: they stay this rank's own, divided by the set's size when
``scale_local_gradients`` (as Horovod). A rank outside the ``process_set`` keeps all its
gradients as they are: it steps alone.

Cross-rank contract: every rank computes gradients for the same variables, in the same
order, with the same settings and the same local variables.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from ddl import ProcessSet, ReduceOp, global_process_set

from ddl.tensorflow._compression import Compression
from ddl.tensorflow._ops import grouped_allreduce, in_order, sparse_allreduce

Average, Sum = ReduceOp.Average, ReduceOp.Sum


def var_name(i: int) -> str:
    """A variable's part of a collective's name: its position, never its own name, which
    Keras makes from counters that differ between ranks that built other models first
    (or loaded this one from a file): ``dense/kernel`` here, ``sequential/dense/kernel``
    there, for the same variable."""
    return str(i)


def reduce_gradients(grads: Sequence, variables: Sequence, *, prefix: str,
                     compression=Compression.none, sparse_as_dense: bool = False,
                     op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                     num_groups: int = 0, groups=None,
                     process_set: ProcessSet = global_process_set,
                     local: Optional[Dict[int, object]] = None,
                     scale_local_gradients: bool = True) -> List:
    """The reduced ``grads`` (None stays None), in order; see the module doc. ``local``:
    ``{id(variable): variable}`` of the variables whose gradients stay local."""
    op = ReduceOp(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=Average")
    if not process_set.included():  # Horovod's: a rank outside the set steps alone
        return list(grads)
    if local:
        return _reduce_partly(list(grads), list(variables), local, scale_local_gradients,
                              dict(prefix=prefix, compression=compression,
                                   sparse_as_dense=sparse_as_dense, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor,
                                   num_groups=num_groups, groups=groups,
                                   process_set=process_set))
    if process_set.size() == 1:
        return list(grads)
    with in_order():
        return _reduce(grads, variables, prefix, compression, sparse_as_dense, op,
                       gradient_predivide_factor, num_groups, groups, process_set)


def _reduce_partly(grads, variables, local, scale, settings) -> List:
    """Reduce the gradients of the shared variables; keep the local ones, divided by the
    set's size when ``scale`` (Horovod's ``scale_local_gradients``)."""
    shared = [i for i, v in enumerate(variables) if id(v) not in local]
    out = list(grads)
    reduced = reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared],
                               **settings)
    for i, g in zip(shared, reduced):
        out[i] = g
    size = settings["process_set"].size()
    if scale and size > 1:
        for i, v in enumerate(variables):
            g = out[i]
            if id(v) not in local or g is None:
                continue
            out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                      if isinstance(g, tf.IndexedSlices) else g / size)
    return out


def _reduce(grads, variables, prefix, compression, sparse_as_dense, op,
            gradient_predivide_factor, num_groups, groups, process_set) -> List:
    pre, post = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    out: List = list(grads)
    dense = []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense or op not in (Sum, Average):  # Adasum needs whole tensors
                g = tf.convert_to_tensor(g)
            else:
                out[i] = sparse_allreduce(g, f"{prefix}/{var_name(i)}", op, process_set)
                continue
        dense.append((i, g))
    for number, members in enumerate(_split(dense, variables, num_groups, groups)):
        wires = [compression.compress(g) for _, g in members]
        reduced = grouped_allreduce([w for w, _ in wires], name=f"{prefix}/group{number}",
                                    op=op, prescale_factor=pre, postscale_factor=post,
                                    process_set=process_set)
        for (i, _), r, (_, ctx) in zip(members, reduced, wires):
            out[i] = compression.decompress(r, ctx)
    return out


def _split(dense, variables, num_groups: int, groups):
    """Groups of ``(index, grad)``: explicit ``groups`` of variables, ``num_groups`` even
    slices, or (default) one group per gradient. An integer ``groups`` is a number of
    groups, as in Horovod."""
    if isinstance(groups, int) and not isinstance(groups, bool):
        num_groups, groups = groups, None
    if num_groups < 0:
        raise ValueError(f"num_groups / groups must be >= 0, got {num_groups}")
    if groups is not None:
        where = {}
        for number, group in enumerate(groups):
            for v in group:
                where[id(v)] = number
        out = [[] for _ in groups]
        rest = []
        for i, g in dense:
            number = where.get(id(variables[i]))
            (rest if number is None else out[number]).append((i, g))
        return [g for g in out if g] + [[x] for x in rest]
    if num_groups and num_groups > 0:
        size = -(-len(dense) // num_groups)
        return [dense[k:k + size] for k in range(0, len(dense), size)]
    return [[x] for x in dense]


def local_variables_of(local_layers) -> List:
    """The trainable variables of ``local_layers`` (a Keras layer, or a list of them)."""
    import keras
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        layers = [local_layers]
    else:
        try:
            layers = list(local_layers)
        except TypeError:
            layers = [local_layers]
    wrong = [type(layer).__name__ for layer in layers
             if not isinstance(layer, keras.layers.Layer)]
    if wrong:
        raise ValueError(f"local_layers must be Keras layers (keras.layers.Layer), got "
                         f"{', '.join(wrong)}")
    return [v for layer in layers for v in layer.trainable_weights]
