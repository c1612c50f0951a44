"""Keras 3 DistributedOptimizer (``ddl.keras.DistributedOptimizer``, and what
``ddl.tensorflow.DistributedOptimizer`` makes of a Keras optimizer): gradients averaged
across ranks before they are applied.

The wrapper transforms gradients: it replaces the optimizer object's ``apply`` (what
``apply_gradients`` and ``model.fit`` call) with one that reduces the gradients first
and then calls the original. It does not look at the optimizer's class or base classes,
so it works for every Keras 3 optimizer, custom ones included. The returned object is the
same optimizer; ``ddl.keras.load_model`` wraps a loaded model's optimizer again.

With ``backward_passes_per_step=N`` the gradients are summed locally over N calls and
reduced once every N; the original ``apply`` runs only on those calls (on the others the
optimizer's ``iterations`` still counts the pass, as in Horovod).

Keras's own machinery is adjusted where a ddl optimizer needs it (:mod:`._keras_hooks`): no
XLA for its model, and a ``LossScaleOptimizer`` around it (mixed precision) decides with
every rank whether a step's gradients are finite.
"""

from __future__ import annotations

import keras

from ddl import ProcessSet, ReduceOp, global_process_set
from ddl.tensorflow import _keras_hooks as _hooks
from ddl.tensorflow._aggregation import GradientAggregator, check_passes
from ddl.tensorflow._compression import Compression
from ddl.tensorflow._gradients import local_variables_of, reduce_gradients

Average = ReduceOp.Average


def DistributedOptimizer(optimizer, name=None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: ReduceOp = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """``optimizer`` (a Keras 3 optimizer), made distributed; returns it.

    ``backward_passes_per_step=N``: sum the gradients of N steps locally (averaged if
    ``average_aggregated_gradients``), reduce them once every N steps and update the
    variables only then. ``optimizer.register_local_var(v)`` keeps ``v``'s gradient local
    (see ``PartialDistributedOptimizer``).

    Cross-rank contract: every rank trains the same model with the same settings.
    ``op=Adasum`` combines each gradient across ranks with :data:`ddl.Adasum` (as Horovod's
    Keras Adasum does); leave the learning rate unscaled by ``size()`` then.

    Example::

        opt = ddl.keras.DistributedOptimizer(keras.optimizers.Adadelta(1.0 * ddl.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    if getattr(optimizer, "_ddl_wrapped", False):
        raise ValueError("this optimizer is already a ddl DistributedOptimizer")
    if not callable(getattr(optimizer, "apply", None)):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (with apply()), "
                        f"not {type(optimizer).__name__}")
    original = optimizer.apply
    local = {}
    settings = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                    gradient_predivide_factor=gradient_predivide_factor,
                    num_groups=num_groups, groups=groups, process_set=process_set,
                    scale_local_gradients=scale_local_gradients)

    def reduce(grads, variables):
        return reduce_gradients(grads, variables, prefix="keras.DistributedOptimizer",
                                local=local, **settings)

    aggregator = None
    if check_passes(backward_passes_per_step) > 1:
        aggregator = GradientAggregator(backward_passes_per_step, average_aggregated_gradients,
                                        reduce, name="keras.DistributedOptimizer")

    def apply(grads, trainable_variables=None):
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(optimizer._trainable_variables))
        if aggregator is None:
            return original(reduce(list(grads), variables), trainable_variables)
        if not optimizer.built:  # not inside the tf.cond below
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
            optimizer.built = True
        summed = aggregator.aggregate(list(grads), variables)
        aggregator.apply(lambda: original(summed, trainable_variables),
                         lambda: optimizer.iterations.assign_add(1), after=summed)

    def register_local_var(var) -> None:
        local[id(var)] = var

    _hooks.install()
    object.__setattr__(optimizer, "apply", apply)
    object.__setattr__(optimizer, "register_local_var", register_local_var)
    object.__setattr__(optimizer, "_ddl_wrapped", True)
    object.__setattr__(optimizer, "_ddl_settings", dict(
        settings, backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients))
    return optimizer


def PartialDistributedOptimizer(optimizer, name=None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0,
                                op: ReduceOp = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups=None,
                                process_set: ProcessSet = global_process_set,
                                local_layers=None, scale_local_gradients: bool = True):
    """A ``DistributedOptimizer`` that leaves the gradients of ``local_layers`` (Keras
    layers) local: not reduced, so each rank's copy of those layers trains on its own data
    (divided by the set's size if ``scale_local_gradients``, as Horovod).

    Cross-rank contract: every rank passes the same layers (in its own model).

    Example::

        opt = ddl.keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    local_layers=[model.layers[-1]])
    """
    local_vars = local_variables_of(local_layers)
    optimizer = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step,
        average_aggregated_gradients, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients)
    for v in local_vars:
        optimizer.register_local_var(v)
    return optimizer
