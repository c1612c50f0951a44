"""A TensorFlow 2 custom training loop with ddl: DistributedGradientTape in a tf.function.

    ddlrun -np 2 python examples/tensorflow2_mnist.py [--data-dir DIR] [--steps N]

Each rank trains on its own shard; the first step broadcasts rank 0's variables (model
and optimizer); only rank 0 prints and writes checkpoints.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as ddl  # noqa: E402
import mnist_data  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir")
    p.add_argument("--steps", type=int, default=300, help="in total, divided among ranks")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--checkpoint-dir")
    args = p.parse_args(argv)

    ddl.init()
    (x_train, y_train), _, source = mnist_data.load(args.data_dir)
    x_train, y_train = x_train[ddl.rank()::ddl.size()], y_train[ddl.rank()::ddl.size()]
    data = (tf.data.Dataset.from_tensor_slices((x_train[..., None], y_train))
            .repeat().shuffle(1000, seed=ddl.rank()).batch(args.batch_size))
    model = keras.Sequential([keras.Input((28, 28, 1)),
                              keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(0.001 * ddl.size())
    if ddl.rank() == 0:
        print(f"training on {source}", flush=True)

    @tf.function
    def train_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = ddl.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:  # after the first step the optimizer's variables exist
            ddl.broadcast_variables(model.variables, root_rank=0)
            ddl.broadcast_variables(opt.variables, root_rank=0)
        return loss

    steps = max(1, args.steps // ddl.size())
    for step, (images, labels) in enumerate(data.take(steps)):
        loss = train_step(images, labels, step == 0)
        if ddl.rank() == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"step {step}: loss {float(loss):.4f}", flush=True)
    if ddl.rank() == 0 and args.checkpoint_dir:
        tf.train.Checkpoint(model=model, optimizer=opt).save(
            os.path.join(args.checkpoint_dir, "ckpt"))
    ddl.shutdown()


if __name__ == "__main__":
    main()
