"""The Keras MNIST CNN trained with ddl.keras (Keras 3 on TensorFlow).

    ddlrun -np 2 python examples/keras_mnist.py [--data-dir DIR] [--epochs N]

The Horovod recipe: epochs divided by the number of ranks, Adadelta with its learning
rate scaled by the number of ranks, the optimizer wrapped in DistributedOptimizer,
BroadcastGlobalVariablesCallback(0) so every rank starts from rank 0's weights, and a
checkpoint callback on rank 0 only. Reads MNIST from ``--data-dir`` (IDX files), else a
synthetic MNIST-shaped set, and says which.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import ddl.keras as ddl  # noqa: E402
import mnist_data  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir")
    p.add_argument("--epochs", type=int, default=12, help="in total, divided among ranks")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch (0: all)")
    p.add_argument("--checkpoint-dir", help="rank 0 writes a checkpoint per epoch here")
    args = p.parse_args(argv)

    ddl.init()
    (x_train, y_train), (x_test, y_test), source = mnist_data.load(args.data_dir)
    x_train, x_test = x_train[..., None], x_test[..., None]
    x_train, y_train = x_train[ddl.rank()::ddl.size()], y_train[ddl.rank()::ddl.size()]
    epochs = int(math.ceil(args.epochs / ddl.size()))
    if ddl.rank() == 0:
        print(f"training on {source}: {len(x_train)} examples per rank, {ddl.size()} "
              f"rank(s), {epochs} epoch(s)", flush=True)

    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10, activation="softmax"),
    ])
    opt = ddl.DistributedOptimizer(keras.optimizers.Adadelta(1.0 * ddl.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt,
                  metrics=["accuracy"])
    callbacks = [ddl.callbacks.BroadcastGlobalVariablesCallback(0),
                 ddl.callbacks.MetricAverageCallback()]
    if ddl.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=epochs,
              steps_per_epoch=args.max_steps or None, callbacks=callbacks,
              verbose=2 if ddl.rank() == 0 else 0)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if ddl.rank() == 0:
        print(f"test loss {loss:.4f}, test accuracy {100 * accuracy:.1f}%", flush=True)
    ddl.shutdown()


if __name__ == "__main__":
    main()
