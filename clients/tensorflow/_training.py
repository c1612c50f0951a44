"""Gradients averaged across ranks, and the initial state broadcast, for TensorFlow.

``DistributedGradientTape`` (TF2 custom loops) and ``DistributedOptimizer`` (for
``tf.compat.v1.train`` optimizers in graphs) reduce every gradient with one grouped
allreduce per group; ``tf.IndexedSlices`` gradients are allgathered (values and indices)
unless ``sparse_as_dense=True`` or ``op=Adasum`` (which densifies them: its dot products
are over whole tensors). With ``op=Adasum`` the gradients are Adasum-combined per tensor
(:data:`ddl.Adasum`), as Horovod's TensorFlow Adasum does; do not scale the learning
rate by ``size()`` then. Gradients of *local* variables (registered, or the
``local_layers`` of ``PartialDistributedGradientTape``) are not reduced: they stay this
rank's own, divided by the set's size when ``scale_local_gradients`` (as Horovod). A rank
outside the ``process_set`` (Horovod's scripts make the optimizer on every rank) keeps
all its gradients as they are: it steps alone.
Cross-rank contract: every rank computes gradients for the same variables, in the same
order, with the same settings and the same local variables.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional, Sequence

import tensorflow as tf

from ddl import ProcessSet, ReduceOp, global_process_set

from ddl.tensorflow._aggregation import GradientAggregator, check_passes
from ddl.tensorflow._compression import Compression
from ddl.tensorflow._gradients import local_variables_of, reduce_gradients, var_name
from ddl.tensorflow._ops import broadcast, in_order

Average = ReduceOp.Average


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over ranks.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = ddl.tensorflow.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(self, tape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups=None,
                 process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True):
        self._tape = tape
        self._local: Dict[int, object] = {}
        self._kwargs = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                            gradient_predivide_factor=gradient_predivide_factor,
                            num_groups=num_groups, groups=groups, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)

    def __getattr__(self, item):
        return getattr(self._tape, item)

    def register_local_source(self, source) -> None:
        """Keep the gradient of ``source`` (a variable) local: not reduced across ranks
        (divided by the set's size if ``scale_local_gradients``)."""
        self._local[id(source)] = source

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(sources)
        reduced = reduce_gradients(tf.nest.flatten(grads), flat,
                                   prefix="DistributedGradientTape", local=self._local,
                                   **self._kwargs)
        return tf.nest.pack_sequence_as(grads, reduced)


def PartialDistributedGradientTape(tape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression=Compression.none,
                                   sparse_as_dense: bool = False, op: ReduceOp = Average,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups=None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers=None, scale_local_gradients: bool = True):
    """A ``DistributedGradientTape`` that leaves the gradients of ``local_layers`` (Keras
    layers) local: they are not reduced, and each rank's copy of those layers trains on
    its own data (divided by the set's size if ``scale_local_gradients``, as Horovod).

    Cross-rank contract: every rank passes the same layers (in its own model).

    Example::

        tape = ddl.tensorflow.PartialDistributedGradientTape(tape, local_layers=[head])
        grads = tape.gradient(loss, model.trainable_variables)
    """
    out = DistributedGradientTape(tape, device_dense, device_sparse, compression,
                                  sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                  groups, process_set, scale_local_gradients)
    for v in local_variables_of(local_layers):
        out.register_local_source(v)
    return out


class DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train`` optimizer whose ``compute_gradients`` returns gradients
    averaged over ranks (graph mode, e.g. under ``MonitoredTrainingSession``).

    With ``backward_passes_per_step=N`` the gradients of N runs are summed locally
    (averaged if ``average_aggregated_gradients``) and reduced once every N runs, and the
    wrapped optimizer applies them only on those runs; on the others ``apply_gradients``
    only increments ``global_step``.

    As Horovod's, a Keras optimizer given here gets :func:`ddl.keras.DistributedOptimizer`
    (with the same keywords; ``use_locking`` and ``device_*`` mean nothing there), so
    ``import ddl.tensorflow as hvd`` scripts can wrap Keras optimizers; anything else is
    a ValueError."""

    def __new__(cls, optimizer, *args, **kwargs):
        if isinstance(optimizer, tf.compat.v1.train.Optimizer):
            return super().__new__(cls)
        import keras
        if isinstance(optimizer, keras.optimizers.Optimizer):
            from ddl.tensorflow._keras_optimizer import \
                DistributedOptimizer as keras_distributed
            bound = inspect.signature(cls.__init__).bind(None, optimizer, *args, **kwargs)
            given = {k: v for k, v in bound.arguments.items()
                     if k not in ("self", "optimizer", "use_locking")}
            return keras_distributed(optimizer, **given)
        raise ValueError(f"ddl.tensorflow.DistributedOptimizer wraps a "
                         f"tf.compat.v1.train.Optimizer or a Keras optimizer; got "
                         f"{type(optimizer).__name__} ({optimizer!r:.80})")

    def __init__(self, optimizer, name: Optional[str] = None, use_locking: bool = False,
                 device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0,
                 average_aggregated_gradients: bool = False, num_groups: int = 0,
                 groups=None, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True):
        super().__init__(use_locking=use_locking,
                         name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._local: Dict[int, object] = {}
        self._kwargs = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                            gradient_predivide_factor=gradient_predivide_factor,
                            num_groups=num_groups, groups=groups, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
        self._aggregator = None
        if check_passes(backward_passes_per_step) > 1:
            self._aggregator = GradientAggregator(
                backward_passes_per_step, average_aggregated_gradients, self._reduce,
                name=self.get_name())

    def register_local_var(self, var) -> None:
        """Keep the gradient of ``var`` local: not reduced across ranks (divided by the
        set's size if ``scale_local_gradients``)."""
        self._local[id(var)] = var

    def _reduce(self, grads, variables):
        return reduce_gradients(grads, variables, prefix="DistributedOptimizer",
                                local=self._local, **self._kwargs)

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._aggregator is not None:
            grads = self._aggregator.aggregate(grads, variables)
        else:
            grads = self._reduce(grads, variables)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if self._aggregator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        grads_and_vars = list(grads_and_vars)

        def skip():
            return None if global_step is None else global_step.assign_add(1)
        out = self._aggregator.apply(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step, name), skip,
            after=[g for g, _ in grads_and_vars])
        return None if tf.executing_eagerly() else tf.group(out)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


# -- broadcast ------------------------------------------------------------------------------

def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, inplace: bool = False,
                        name: str = "broadcast_variables"):
    """Assign ``root_rank``'s values to ``variables`` on every rank (eagerly, or as ops
    inside a ``tf.function``); returns the assign op in a graph. Horovod's signature:
    ``inplace`` is accepted and changes nothing (every variable is assigned in place)."""
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    with in_order():
        assigns = [v.assign(broadcast(v, root_rank, name=f"{name}/{var_name(i)}",
                                      process_set=process_set))
                   for i, v in enumerate(variables)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_(variables: Sequence[tf.Variable], root_rank: int,
               name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> list:
    """Horovod's in-place broadcast: assign ``root_rank``'s values to ``variables`` on
    every member of ``process_set`` and return them, one per variable (eagerly the
    variables themselves; in a graph or ``tf.function``, their values after the
    assignment). Every member passes variables of the same dtypes and shapes, in the
    same order; ``root_rank``'s are not changed. Example::

        w = tf.Variable(tf.fill([3], float(hvd.rank())))
        (w,) = hvd.broadcast_([w], root_rank=0)     # w is 0.0 everywhere
    """
    variables = list(variables)
    base = "broadcast_" if name is None else name
    with in_order():
        assigns = [v.assign(broadcast(v, root_rank, name=f"{base}/{var_name(i)}",
                                      process_set=process_set))
                   for i, v in enumerate(variables)]
    return variables if tf.executing_eagerly() else list(assigns)


def broadcast_global_variables(root_rank: int = 0):
    """Graph mode: an op that assigns ``root_rank``'s values to every global variable.

    Eagerly there is no collection of global variables, so this raises ``RuntimeError``
    (as Horovod's does) rather than broadcast nothing: use :func:`broadcast_variables`
    with the model's and the optimizer's variables."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "ddl.tensorflow.broadcast_global_variables() needs a tf.compat.v1 graph: "
            "eagerly (TensorFlow 2) there are no global variables to broadcast. Use "
            "broadcast_variables(model.variables, root_rank) and "
            "broadcast_variables(optimizer.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank,
                               name="broadcast_global_variables")


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts the global variables from ``root_rank`` once the session is created
    (e.g. under ``tf.compat.v1.train.MonitoredTrainingSession``)."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self._op = None

    def begin(self):
        if self._op is None or self._op.graph is not tf.compat.v1.get_default_graph():
            self._op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self._op)
