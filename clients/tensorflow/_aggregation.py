"""Local gradient aggregation: Horovod's ``backward_passes_per_step`` for TensorFlow.

A :class:`GradientAggregator` adds each backward pass's gradients into local sums (one
non-trainable variable per gradient) and reduces the sums across ranks once every
``passes`` calls; the optimizer then applies them only on those steps. It builds
``tf.cond`` ops, so the same object works eagerly, inside a ``tf.function`` (Keras
``model.fit``) and in a ``tf.compat.v1`` graph (where its variables are local variables,
initialised by ``tf.compat.v1.local_variables_initializer`` or a ``MonitoredTrainingSession``).

Cross-rank contract: every rank uses the same ``passes`` and calls the optimizer the same
number of times, so that all ranks reach the reducing step together.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from ddl.tensorflow import _ops


def check_passes(backward_passes_per_step) -> int:
    """``backward_passes_per_step`` as an int >= 1, or a ValueError that names it."""
    if (isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1):
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}")
    return backward_passes_per_step


def _dense(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _local_variable(value, name: str):
    """A non-trainable variable created outside any function being traced."""
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    with tf.init_scope():
        value = value() if callable(value) else value
        if tf.executing_eagerly():
            return tf.Variable(value, trainable=False, name=name)
        return tf.compat.v1.Variable(
            value, trainable=False, name=name, use_resource=True,
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _after(fn: Callable[[], object]) -> Callable[[], tf.Tensor]:
    """A ``tf.cond`` branch that runs ``fn`` and returns a constant once it has run."""
    def branch():
        result = fn()
        deps = [] if tf.executing_eagerly() or result is None else [result]
        with tf.control_dependencies(deps):
            return tf.constant(True)
    return branch


class GradientAggregator:
    """Sums gradients over ``passes`` backward passes and reduces the sums (divided by
    ``passes`` when ``average``) once every ``passes`` calls of :meth:`aggregate`, with
    ``reduce(grads, variables)``; :meth:`apply` runs the update only after a reducing call.
    ``tf.IndexedSlices`` gradients are summed densely."""

    def __init__(self, passes: int, average: bool,
                 reduce: Callable[[List, List], List], name: str):
        self.passes = check_passes(passes)
        self.average = bool(average)
        self._reduce = reduce
        self._name = name
        self._counter = None
        self._sums: Optional[List] = None

    def _build(self, grads, variables) -> None:
        self._counter = _local_variable(lambda: tf.constant(0, tf.int64),
                                        f"{self._name}_aggregation_counter")
        self._sums = [None if g is None else _local_variable(
            lambda g=g, v=v: tf.zeros(v.shape, g.dtype), f"{self._name}_aggregated_{i}")
            for i, (g, v) in enumerate(zip(grads, variables))]

    def aggregate(self, grads: Sequence, variables: Sequence) -> List:
        """Adds ``grads`` to the local sums; on every ``passes``-th call returns the reduced
        sums (and clears them), on the others the local sums so far (not to be applied)."""
        grads = [_dense(g) for g in grads]
        variables = list(variables)
        if self._sums is None:
            self._build(grads, variables)
        if len(self._sums) != len(grads):
            raise ValueError(f"backward_passes_per_step: this optimizer aggregated "
                             f"{len(self._sums)} gradients before and now got {len(grads)}; "
                             f"use one optimizer per set of variables")
        slots = [i for i, (g, s) in enumerate(zip(grads, self._sums))
                 if g is not None and s is not None]
        if not slots:
            return list(grads)
        adds = [self._sums[i].assign_add(grads[i]) for i in slots]
        with tf.control_dependencies(adds):
            count = self._counter.assign_add(1)

        def reduce():
            totals = [None] * len(grads)
            for i in slots:
                total = self._sums[i].read_value()
                totals[i] = total / self.passes if self.average else total
            reduced = self._reduce(totals, variables)
            with tf.control_dependencies([reduced[i] for i in slots]):
                clear = [self._sums[i].assign(tf.zeros_like(self._sums[i])) for i in slots]
                clear.append(self._counter.assign(0))
            with tf.control_dependencies(clear):
                return [tf.identity(reduced[i]) for i in slots]

        def keep():
            return [tf.identity(self._sums[i].read_value()) for i in slots]

        # The collectives inside the branch chain among themselves only (in_order).
        previous, _ops._order.last = _ops._order.last, None
        deps = [count] + ([previous] if previous is not None else [])
        with tf.control_dependencies(deps):
            chosen = tf.cond(count >= self.passes, reduce, keep)
        if not isinstance(chosen, (list, tuple)):
            chosen = [chosen]
        _ops._order.last = chosen[0].op if _ops._order.depth and not \
            tf.executing_eagerly() else None
        out = list(grads)
        for i, g in zip(slots, chosen):
            out[i] = g
        return out

    def apply(self, apply_fn: Callable[[], object], skip_fn: Callable[[], object],
              after: Sequence = ()):
        """Runs ``apply_fn()`` if the last :meth:`aggregate` reduced, else ``skip_fn()``
        (both after ``after``, the gradients); returns the ``tf.cond``'s output."""
        deps = [] if tf.executing_eagerly() else [t for t in after if t is not None]
        with tf.control_dependencies(deps):
            reduced = tf.equal(self._counter.read_value(), 0)
        return tf.cond(reduced, _after(apply_fn), _after(skip_fn))
