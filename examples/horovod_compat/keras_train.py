"""A Keras training script written for Horovod; only the import line differs
(``import horovod.tensorflow.keras as hvd`` in the original)."""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import ddl.keras as hvd  # noqa: E402  (was: import horovod.tensorflow.keras as hvd)

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

hvd.init()
rng = np.random.default_rng(hvd.rank())
w_true = np.random.default_rng(0).standard_normal((20, 4))
x = rng.standard_normal((512, 20)).astype("float32")
y = (x @ w_true).argmax(axis=1)

model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(4)])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size()))
model.compile(optimizer=opt, metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback(),
             hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05 * hvd.size(),
                                                      warmup_epochs=1, verbose=0)]
model.fit(x, y, batch_size=32, epochs=args.epochs, callbacks=callbacks,
          verbose=2 if hvd.rank() == 0 else 0)

digest = np.array([sum(float(np.sum(w)) for w in model.get_weights())], np.float32)
everyone = hvd.allgather(tf.constant(digest))
assert np.allclose(everyone.numpy(), everyone.numpy()[0], atol=1e-4), everyone
if hvd.rank() == 0:
    print("HOROVOD SCRIPT OK: keras", flush=True)
