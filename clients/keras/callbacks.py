"""Keras callbacks for distributed training.

Cross-rank contract: every rank uses the same callbacks with the same arguments.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import keras
import numpy as np
import tensorflow as tf

import ddl
from ddl.tensorflow._training import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every rank takes ``root_rank``'s model and optimizer variables, so all ranks train
    from the same state: at the start of training, before the first step, where every
    rank's model is built (its optimizer is built then if it is not yet, so that a rank
    that loaded a trained model and one that made a new one hold the same variables);
    otherwise after the first batch, as Horovod's does. ``local_variables`` (a variable
    or a list of them, e.g. the weights of a ``PartialDistributedOptimizer``'s local
    layers) keep each rank's own values; ``register_local_var(v)`` adds one. ``device``
    is Horovod's and changes nothing.

    Cross-rank contract: every rank passes the same ``root_rank`` and the same local
    variables (in its own model), and holds the same model and optimizer: ranks whose
    numbers of variables differ all raise ``ValueError`` naming them."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = {}
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        wrong = [type(v).__name__ for v in local_variables if not _is_variable(v)]
        if wrong:
            raise ValueError(f"BroadcastGlobalVariablesCallback: local_variables must be "
                             f"variables (keras.Variable or tf.Variable), got "
                             f"{', '.join(wrong)}")
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var) -> None:
        """Leave ``var`` (a model or optimizer variable) out of the broadcast."""
        self._local[id(var)] = var

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast(after_a_batch=False)

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast(after_a_batch=True)

    def _broadcast(self, after_a_batch: bool) -> None:
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if model.built and optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)  # what fit's first step would do
        variables = list(model.variables) + list(getattr(optimizer, "variables", []))
        variables = [v for v in variables if id(v) not in self._local]
        name = "keras/broadcast_global_variables"
        every = ddl.allgather(np.array([[int(model.built), len(variables)]], np.int64),
                              name=f"{name}/ready")
        if not after_a_batch and not every[:, 0].all():
            return  # a model built by its first batch: after that batch
        if len(set(every[:, 1].tolist())) > 1:
            counts = ", ".join(f"rank {r}: {c}" for r, c in enumerate(every[:, 1].tolist()))
            raise ValueError(f"BroadcastGlobalVariablesCallback: the ranks hold different "
                             f"numbers of model and optimizer variables ({counts}); every "
                             f"rank needs the same model, optimizer and local_variables")
        broadcast_variables(variables, self.root_rank, name=name)
        self.broadcast_done = True


def _is_variable(v) -> bool:
    return isinstance(v, (keras.Variable, tf.Variable))


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replaces each metric in ``logs`` by its average over
    the ranks (put it before callbacks that read the metrics, e.g. checkpoints).
    ``device`` is Horovod's and changes nothing."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = ddl.allreduce(values, name="keras/metric_average", op=ddl.Average)
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _set_lr(model, lr: float) -> None:
    opt = model.optimizer
    if hasattr(opt.learning_rate, "assign"):
        opt.learning_rate.assign(lr)
    else:
        opt.learning_rate = lr


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch``
    until ``end_epoch`` (exclusive; None: the end). ``multiplier`` is a function of the
    epoch, or a number ``m``: exponential decay from ``start_epoch``, ``m ** (epoch -
    start_epoch)`` (so ``initial_lr`` at ``start_epoch``, then ``initial_lr * m``, ...), as
    Horovod's since 0.23; for a constant factor pass ``lambda epoch: m``. With
    ``staircase=False`` the rate is set every batch, at the fractional epoch ``epoch +
    batch / steps_per_epoch``, else once at the start of each epoch.

    ``momentum_correction`` is accepted for Horovod compatibility and has no effect:
    Keras 3 compiles an optimizer's momentum into the training step, so it cannot be
    rescaled for one step when the rate changes."""

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{type(self).__name__} needs initial_lr (the rate the "
                             f"multipliers apply to, e.g. 0.01 * size()), got None")
        self.initial_lr = float(initial_lr)
        self.multiplier = (multiplier if callable(multiplier)
                           else (lambda e: multiplier ** (e - start_epoch)))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self.history = []  # (fractional epoch, learning rate) as set

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _apply(self, epoch: float) -> None:
        lr = self.initial_lr * float(self.multiplier(epoch))
        _set_lr(self.model, lr)
        self.history.append((epoch, lr))

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self._active(epoch) and self.staircase:
            self._apply(epoch)

    def on_batch_begin(self, batch, logs=None):
        if self._active(self.current_epoch) and not self.staircase:
            if not self.steps_per_epoch:
                raise ValueError("LearningRateScheduleCallback(staircase=False) needs "
                                 "steps_per_epoch (fit did not say how many steps an "
                                 "epoch has)")
            self._apply(self.current_epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size`` up to ``initial_lr`` over the
    first ``warmup_epochs`` epochs, batch by batch (Goyal et al., "Accurate, Large
    Minibatch SGD"): at fractional epoch ``e = epoch + (batch + 1) / steps_per_epoch``,
    ``lr = initial_lr / size * (1 + e * (size - 1) / warmup_epochs)``; afterwards it is
    left alone. ``initial_lr`` is the already scaled rate (e.g. ``0.01 * size``)."""

    def __init__(self, initial_lr: float, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        size = ddl.size()
        self.warmup_epochs = warmup_epochs

        def multiplier(epoch: float) -> float:
            return (1.0 + epoch * (size - 1) / warmup_epochs) / size

        super().__init__(initial_lr, multiplier, start_epoch=0,
                         end_epoch=int(np.ceil(warmup_epochs)), staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)

    def on_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch + (batch + 1) / (self.steps_per_epoch or 1)
        if self._active(self.current_epoch) and epoch <= self.warmup_epochs:
            if not self.steps_per_epoch:
                raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (fit did "
                                 "not say how many steps an epoch has)")
            self._apply(epoch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.end_epoch - 1 and ddl.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True`` that writes on
    rank 0 only: it saves the whole model to ``filepath`` whenever ``monitor`` improves.
    As in Horovod the path is not an argument: set ``best_model.filepath`` (ending in
    ``.keras`` or ``.h5``) before training. Put ``MetricAverageCallback`` before it so
    that rank 0 judges by the metrics averaged over the ranks."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq="epoch"):
        super().__init__(filepath="best.keras", monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)
        self.filepath = None

    def on_train_begin(self, logs=None):
        path = None if self.filepath is None else str(self.filepath)
        if path is None or not path.endswith((".keras", ".h5")):
            raise ValueError(f"BestModelCheckpoint needs best_model.filepath set to a path "
                             f"ending in .keras or .h5 before training, got {path!r}")
        self.filepath = path
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        if ddl.rank() == 0:
            super()._save_model(epoch, batch, logs)
