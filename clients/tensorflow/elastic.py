"""``ddl.tensorflow.elastic``: elastic training with TensorFlow (Horovod's
``horovod.tensorflow.elastic``).

Everything of :mod:`ddl.elastic`, with a :func:`run` that also recognises ddl's errors
inside TensorFlow graphs, :class:`TensorFlowState` (variables and plain values) and
:class:`TensorFlowKerasState` (a Keras model and its optimizer; ``ddl.keras.elastic.
KerasState`` is the same).

A lost worker costs the survivors the time their training function takes to give the
error back. A ``for`` loop over a ``tf.data`` dataset made inside the function (Horovod's
``dataset.skip(state.batch)``) ends its iterator on the way out, and TensorFlow 2.21 may
wait there for the iterator's autotuning thread to finish a sleep that grows as training
goes on, up to a minute by TensorFlow's source (measured: 0 to 10 s after 10 to 20 s of
training, in 5 of 12 runs). Turn autotuning
off for that dataset (``options = tf.data.Options(); options.autotune.enabled = False;
dataset = dataset.with_options(options)``), or make the iterator outside the function,
when a reset must be quick; ``ddl.elastic`` names a slow one in its warning.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from ddl._client_api import raising_ddl_errors
from ddl.elastic import HostsUpdatedInterrupt, NotEnoughRanksError, ObjectState, State
from ddl.elastic import run as _run

from ddl.tensorflow._training import broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
           "HostsUpdatedInterrupt", "NotEnoughRanksError"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`ddl.elastic.run` for TensorFlow: a collective that fails inside a graph
    (``tf.function``, ``model.fit``) reaches the caller as a ``tf.errors.OpError``; this
    raises the ddl error it carries instead (``PeerLostError``...), so that the elastic
    loop recognises a lost worker."""
    return _run(raising_ddl_errors(func, tf.errors.OpError))


def _values(variables: Sequence[Any]) -> List[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


class TensorFlowState(ObjectState):
    """Variables (``tf.Variable`` or Keras variables) and plain values as attributes:
    ``TensorFlowState(model.variables + opt.variables, epoch=0, batch=0)``.

    ``save()`` copies the variables' values to host memory (and deep-copies the plain
    values), ``restore()`` assigns them back, ``sync()`` (a collective) assigns rank 0's
    values on every rank (:func:`ddl.tensorflow.broadcast_variables`) and takes rank 0's
    plain values (:class:`ObjectState`), then saves. Every rank must hold the same
    variables (names, shapes, dtypes), in the same order.
    """

    def __init__(self, variables: Optional[Sequence[Any]] = None, **kwargs: Any) -> None:
        self._variables = list(variables or [])
        self._saved_values: List[np.ndarray] = []
        super().__init__(**kwargs)
        self._save_variables()

    def tracked_variables(self) -> List[Any]:
        """The variables this state saves, restores and syncs."""
        return list(self._variables)

    def _save_variables(self) -> None:
        self._saved_values = _values(self.tracked_variables())

    def save(self) -> None:
        super().save()
        self._save_variables()

    def restore(self) -> None:
        variables = self.tracked_variables()
        if len(variables) != len(self._saved_values):
            raise ValueError(f"{type(self).__name__}.restore: {len(variables)} variables now, "
                             f"{len(self._saved_values)} at the last commit; create every "
                             f"variable before the state (build the model and optimizer)")
        for v, value in zip(variables, self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.tracked_variables(), 0,
                            name=f"ddl.elastic.{type(self).__name__}")
        super().sync()
        self._save_variables()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer (default ``model.optimizer``) and plain values
    (``epoch=0, batch=0``) as attributes (``state.model``, ``state.epoch``).

    ``save()`` copies the model's variables and the optimizer's (its iteration count,
    learning rate and slots) to host memory and deep-copies the plain values;
    ``restore()`` assigns them back; ``sync()`` (a collective) gives every rank rank 0's
    variables and values, then saves. The model must be built (it has its variables)
    when the state is made; the optimizer is built here if it is not yet, so that every
    rank, a newly added one too, has the same variables to receive.
    """

    def __init__(self, model: keras.Model, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend   # Horovod's Keras backend module: nothing to do with it here
        if not model.variables:
            raise ValueError(f"{type(self).__name__}: the model has no variables yet; build "
                             f"it first (model.build(input_shape), or call it on a batch)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        super().__init__(None, **kwargs)

    def tracked_variables(self) -> List[Any]:
        optimizer = self.optimizer
        if optimizer is None:
            return list(self.model.variables)
        if not optimizer.built:
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(self.model.trainable_variables)
        return list(self.model.variables) + list(optimizer.variables)
