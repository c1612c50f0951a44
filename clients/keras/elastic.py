"""``ddl.keras.elastic``: elastic training with Keras (Horovod's
``horovod.tensorflow.keras.elastic``): everything of :mod:`ddl.elastic`, ``KerasState``
and the callbacks that commit it and keep its epoch and batch.

Example::

    import ddl.keras as ddl
    ddl.init()
    model.compile(optimizer=ddl.DistributedOptimizer(opt), loss=...)
    state = ddl.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: model.optimizer.learning_rate.assign(
        base_lr * ddl.size())])
    callbacks = [ddl.elastic.UpdateEpochStateCallback(state),
                 ddl.elastic.UpdateBatchStateCallback(state),
                 ddl.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @ddl.elastic.run
    def train(state):
        model.fit(data, initial_epoch=state.epoch, epochs=epochs, callbacks=callbacks)

    train(state)

Cross-rank contract: as for every elastic state, each rank builds the same model and
optimizer, uses the same callbacks with the same arguments, and so commits at the same
batches (``commit()`` is a collective).
"""

from __future__ import annotations

from typing import Any

import keras

from ddl.elastic import HostsUpdatedInterrupt, NotEnoughRanksError, ObjectState, State
from ddl.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "HostsUpdatedInterrupt", "NotEnoughRanksError"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (default ``model.optimizer``) and plain values
    (``epoch=0, batch=0``) as attributes: Horovod's ``horovod.tensorflow.keras.elastic.
    KerasState``, the same as :class:`ddl.tensorflow.elastic.TensorFlowKerasState`
    (saved, restored and synced as that says)."""

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every
    epoch. Put it after the ``Update*StateCallback``s, so that a commit saves the
    updated epoch and batch."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be >= 1, got "
                             f"{batches_per_commit}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` = the number of batches finished in the current epoch
    (0 at the end of an epoch). Keras restarts an interrupted epoch at its first batch:
    to resume where the commit was, skip ``state.batch`` batches of that epoch's data."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` = the number of epochs finished: ``epoch + 1`` at the end of
    Keras's epoch ``epoch`` (Keras counts from ``fit(initial_epoch=state.epoch)``, so a
    resumed ``fit`` carries the count on)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
