"""SyncBatchNormalization: Keras batch normalization over the global batch of all ranks."""

from __future__ import annotations

import keras
import tensorflow as tf

from ddl import ProcessSet, Sum, global_process_set
from ddl.tensorflow._ops import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics are those of the
    global batch: every call sums each rank's per-channel sum, sum of squares and count
    with one allreduce, so ranks may hold different batch sizes (even zero rows). The
    allreduce is differentiable, so gradients flow through the global statistics as in
    one process with the concatenated batch. Inference uses the moving statistics, which
    every rank updates with the same global values.

    Cross-rank contract: every rank calls the layer the same number of times per step,
    with the same ``training`` flag and the same shape except the batch dimension.

    Example::

        model = keras.Sequential([keras.layers.Conv2D(8, 3),
                                  ddl.tensorflow.SyncBatchNormalization(), ...])
    """

    def __init__(self, fused=False, process_set: ProcessSet = global_process_set, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        super().__init__(**kwargs)
        self._process_set = process_set

    def _moments(self, inputs, mask):
        if self._process_set.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(x[..., :1]) if len(x.shape) > 1 else tf.ones_like(x)
        else:
            weights = tf.cast(tf.expand_dims(mask, -1), x.dtype)
        weights = tf.broadcast_to(weights, tf.shape(x))
        local = tf.stack([tf.reduce_sum(x * weights, axes),
                          tf.reduce_sum(tf.square(x) * weights, axes),
                          tf.reduce_sum(weights, axes)])
        total = allreduce(local, op=Sum, name=f"SyncBatchNormalization/{self.name}",
                          process_set=self._process_set)
        count = tf.maximum(total[2], 1.0)
        mean = total[0] / count
        variance = tf.maximum(total[1] / count - tf.square(mean), 0.0)
        return mean, variance
