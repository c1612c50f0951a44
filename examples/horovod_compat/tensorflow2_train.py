"""A TensorFlow 2 training script written for Horovod; only the import line differs
(``import horovod.tensorflow as hvd`` in the original)."""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402  (was: import horovod.tensorflow as hvd)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

hvd.init()
tf.random.set_seed(1234 + hvd.rank())

model = tf.keras.Sequential([tf.keras.Input((20,)), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(4)])
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.keras.optimizers.SGD(0.05 * hvd.size())
w_true = tf.random.stateless_normal((20, 4), seed=(0, 0))


@tf.function
def training_step(x, y, first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:  # after the first step, when the optimizer's variables exist
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss


for step in range(args.steps):
    x = tf.random.normal((32, 20))
    y = tf.argmax(x @ w_true, axis=1)
    loss = training_step(x, y, step == 0)
    if step % 10 == 0 and hvd.rank() == 0:
        print(f"step {step}: loss {float(loss):.4f}", flush=True)

digest = tf.reshape(tf.add_n([tf.reduce_sum(v) for v in model.variables]), (1,))
everyone = hvd.allgather(digest)
assert bool(tf.reduce_all(tf.abs(everyone - everyone[0]) < 1e-5)), everyone
if hvd.rank() == 0:
    print("HOROVOD SCRIPT OK: tensorflow", flush=True)
