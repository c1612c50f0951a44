"""Keras 3 DistributedOptimizer: gradients averaged across ranks before they are applied.

The wrapper transforms gradients: it replaces the optimizer object's ``apply`` (what
``apply_gradients`` and ``model.fit`` call) with one that reduces the gradients first
and then calls the original. It does not look at the optimizer's class or base classes,
so it works for every Keras 3 optimizer, custom ones included. The returned object is the
same optimizer; ``ddl.keras.load_model`` wraps a loaded model's optimizer again.
"""

from __future__ import annotations

from ddl import ProcessSet, ReduceOp, global_process_set
from ddl.tensorflow._training import Compression, reduce_gradients

Average = ReduceOp.Average


def DistributedOptimizer(optimizer, name=None, compression=Compression.none,
                         sparse_as_dense: bool = False, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, process_set: ProcessSet = global_process_set):
    """``optimizer`` (a Keras 3 optimizer), made distributed; returns it.

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
    settings = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                    gradient_predivide_factor=gradient_predivide_factor,
                    num_groups=num_groups, groups=groups, process_set=process_set)

    def apply(grads, trainable_variables=None):
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(optimizer._trainable_variables))
        reduced = reduce_gradients(list(grads), variables, prefix="keras.DistributedOptimizer",
                                   **settings)
        return original(reduced, trainable_variables)

    object.__setattr__(optimizer, "apply", apply)
    object.__setattr__(optimizer, "_ddl_wrapped", True)
    object.__setattr__(optimizer, "_ddl_settings", settings)
    return optimizer
