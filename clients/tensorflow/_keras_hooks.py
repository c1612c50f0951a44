"""Where Keras 3's own training machinery must treat a model with a ddl optimizer
differently. Keras has no public hook for either, so each replaces one private function
or method with one that changes nothing for other models; :func:`install` is called when
the first ``DistributedOptimizer`` is made, and installs each once.

- **No XLA.** ddl's collectives are host callbacks, which XLA cannot compile, and Keras
  compiles a model's training step with XLA where it can (``jit_compile="auto"``, its
  default, on a machine with a GPU). Its test of whether a model supports XLA
  (``model_supports_jit``, asked by ``Model.compile`` after it set the model's
  optimizer) answers no for a model whose optimizer, or the loss-scale optimizer's inner
  one, is ddl's: "auto" resolves to False, ``jit_compile=True`` gets Keras's warning and
  False. Where that function is gone, such a model fails at trace time instead, with
  ddl.tensorflow's error saying to pass ``jit_compile=False``.
- **Mixed precision agrees on overflow.** A ``LossScaleOptimizer`` (which
  ``Model.compile`` puts around the optimizer under the ``mixed_float16`` policy) checks
  whether the gradients are finite and skips the step when they are not, before its
  inner optimizer reduces them: ranks where only one overflowed would take different
  branches, one making the gradients' collective and the other not, and stall. Around a
  ddl optimizer its check is agreed: a step is skipped on every rank when any rank's
  gradients are not finite (what Horovod's order, reducing first, gives), for one small
  allreduce per step. A rank outside the optimizer's process set, which steps alone,
  decides alone.
"""

from __future__ import annotations

import keras
import tensorflow as tf

import ddl
from ddl.tensorflow._ops import allreduce

_installed = set()


def install() -> None:
    for hook in (_no_xla, _agreed_overflow):
        if hook not in _installed:
            _installed.add(hook)
            hook()


def _ddl_inner(optimizer):
    """``optimizer`` or the loss-scale optimizer's inner one, if it is a ddl one."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if getattr(opt, "_ddl_wrapped", False):
            return opt
    return None


def _no_xla() -> None:
    try:
        from keras.src.trainers import trainer
    except ImportError:   # pragma: no cover - another Keras layout
        return
    keras_answer = getattr(trainer, "model_supports_jit", None)
    if keras_answer is None:   # pragma: no cover
        return

    def model_supports_jit(model) -> bool:
        if _ddl_inner(getattr(model, "optimizer", None)) is not None:
            return False
        return keras_answer(model)

    trainer.model_supports_jit = model_supports_jit


def _agreed_overflow() -> None:
    cls = keras.optimizers.LossScaleOptimizer
    keras_check = cls.check_finite

    def check_finite(self, grads):
        finite = keras_check(self, grads)
        inner = self.inner_optimizer   # (a ddl optimizer around this one reduced first)
        if not getattr(inner, "_ddl_wrapped", False) or getattr(self, "_ddl_wrapped", False):
            return finite
        process_set = inner._ddl_settings["process_set"]
        if not process_set.included() or process_set.size() == 1:
            return finite
        every = allreduce(tf.reshape(tf.cast(finite, tf.int32), [1]), op=ddl.Min,
                          name="keras.LossScaleOptimizer/finite", process_set=process_set)
        return tf.reduce_all(every > 0)

    cls.check_finite = check_finite
