"""Elastic training with Keras: a small regression on synthetic data that carries on when
workers come and go.

    ddlrun --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/elastic_keras.py            # elastic
    ddlrun -np 2 python examples/elastic_keras.py       # fixed world
    python examples/elastic_keras.py                    # one process

What makes it elastic: ``KerasState`` holds the model, its optimizer and the counters;
``CommitStateCallback`` commits every ``--commit-every`` batches and at the end of each
epoch (the point a failure rolls back to, and where ddlrun may add workers);
``UpdateEpochStateCallback`` and ``UpdateBatchStateCallback`` keep ``state.epoch`` and
``state.batch``; the learning rate follows the world's size in a reset callback;
``ddl.elastic.run`` forms a new world after a change and calls ``train`` again.

The data: each epoch is a permutation of the data set, eaten in global batches of
``--batch-size`` samples per rank (rank r takes the r-th slice of each); ``state.offset``
counts the samples of the epoch already trained, so that a new world of any size carries
on from the last commit. The tail that cannot fill a batch on every rank is left out of
the epoch (as ``drop_last``). Rank 0 ends with ``done: E epochs, world sizes [..], samples
S, checksum C``: the size of every world that trained, the samples trained and kept, and
the sum of the model's weights.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ddl.keras as ddl  # noqa: E402


class TrackSamples(keras.callbacks.Callback):
    """``state.offset``: samples of this epoch trained (by every rank together);
    ``state.samples``: samples trained in all. Before ``CommitStateCallback``."""

    def __init__(self, state, global_batch: int):
        super().__init__()
        self.state, self.global_batch = state, global_batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.offset += self.global_batch
        self.state.samples += self.global_batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.offset = 0


class Sleep(keras.callbacks.Callback):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96, help="size of the data set")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--commit-every", type=int, default=4, help="batches between commits")
    p.add_argument("--lr", type=float, default=0.01, help="per rank (scaled by size)")
    p.add_argument("--sleep", type=float, default=0.0,
                   help="seconds to wait after each batch (to watch workers come and go)")
    args = p.parse_args()

    ddl.init()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 8)).astype(np.float32)
    y = (x @ np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(8, 1) +
         0.1 * rng.standard_normal((args.samples, 1)).astype(np.float32))

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    opt = ddl.DistributedOptimizer(keras.optimizers.SGD(args.lr * ddl.size(), momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    state = ddl.elastic.KerasState(model, epoch=0, batch=0, offset=0, samples=0, sizes=[])
    state.register_reset_callbacks([lambda: opt.learning_rate.assign(args.lr * ddl.size())])

    @ddl.elastic.run
    def train(state) -> None:
        state.sizes = state.sizes + [ddl.size()]
        state.commit()
        size, rank, bs = ddl.size(), ddl.rank(), args.batch_size
        callbacks = [TrackSamples(state, bs * size),
                     ddl.elastic.UpdateEpochStateCallback(state),
                     ddl.elastic.UpdateBatchStateCallback(state),
                     ddl.elastic.CommitStateCallback(state, args.commit_every)]
        if args.sleep:
            callbacks.insert(0, Sleep(args.sleep))
        while state.epoch < args.epochs:
            order = np.random.default_rng(state.epoch).permutation(args.samples)
            rest = order[state.offset:]
            steps = len(rest) // (bs * size)
            if steps == 0:  # what is left cannot fill a batch on every rank
                state.epoch, state.offset, state.batch = state.epoch + 1, 0, 0
                state.commit()
                continue
            mine = rest[:steps * bs * size].reshape(steps, size, bs)[:, rank].reshape(-1)
            epoch = state.epoch
            history = model.fit(x[mine], y[mine], batch_size=bs, shuffle=False,
                                initial_epoch=epoch, epochs=epoch + 1, verbose=0,
                                callbacks=callbacks)
            if rank == 0:
                print(f"epoch {state.epoch}: loss {history.history['loss'][-1]:.4f} on "
                      f"{size} rank(s)", flush=True)

    train(state)
    checksum = float(sum(np.asarray(v, np.float64).sum() for v in model.trainable_weights))
    if ddl.rank() == 0:
        sizes = ", ".join(str(s) for s in state.sizes)
        print(f"done: {state.epoch} epochs, world sizes [{sizes}], samples {state.samples}, "
              f"checksum {checksum:.6e}", flush=True)
    ddl.shutdown()


if __name__ == "__main__":
    main()
