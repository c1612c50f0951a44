"""Keras callbacks for distributed training.

Cross-rank contract: every rank uses the same callbacks with the same arguments.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import keras
import numpy as np

import ddl
from ddl.tensorflow._training import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, every rank takes ``root_rank``'s model and optimizer
    variables, so all ranks start from the same state."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, name="keras/broadcast_global_variables")
        self.broadcast_done = True


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
    """Sets the learning rate to ``initial_lr * multiplier`` from ``start_epoch`` until
    ``end_epoch`` (exclusive; None: the end). ``multiplier`` is a number or a function of
    the epoch; with ``staircase=False`` it is called every batch with a fractional epoch
    (``epoch + batch / steps_per_epoch``), else once at the start of each epoch.

    ``momentum_correction`` is accepted for Horovod compatibility and has no effect:
    Keras 3 compiles an optimizer's momentum into the training step, so it cannot be
    rescaled for one step when the rate changes."""

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda e: multiplier)
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
