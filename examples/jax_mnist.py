"""Train a small CNN on MNIST with flax nnx, optax and ddl.jax: the four changes.

    ddlrun -np 2 python examples/jax_mnist.py [--data-dir DIR] [--epochs 2]

With ``--data-dir`` it reads MNIST from the four IDX files there (``train-images-idx3-
ubyte``, ``train-labels-idx1-ubyte``, ``t10k-...``, optionally gzipped); without, it uses a
synthetic MNIST-shaped data set (and says so). Each rank trains on its own shard of the
data. The train step is one ``nnx.jit``-compiled function: the forward and backward
passes, the gradient allreduce of ``ddl.jax.DistributedOptimizer`` (one fused collective,
run inside the compiled step) and the optimizer update. Only rank 0 prints metrics and
saves checkpoints (``--checkpoint-dir``, the model's parameters as ``.npz``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ddl.jax as ddl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist_data  # noqa: E402


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (5, 5), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (5, 5), padding="VALID", rngs=rngs)
        self.fc1 = nnx.Linear(512, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        pool = lambda y: nnx.max_pool(y, (2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.conv1(x)))
        x = pool(nnx.relu(self.conv2(x)))
        return self.fc2(nnx.relu(self.fc1(x.reshape(x.shape[0], -1))))


def progress(epoch: int, done: int, steps: int, loss: float) -> None:
    """A progress bar on a terminal; under ddlrun (a pipe), a line every fifth."""
    if sys.stdout.isatty():
        bar = done * 30 // steps
        print(f"\repoch {epoch} [{'=' * bar}{' ' * (30 - bar)}] {done}/{steps} "
              f"loss {loss:.4f}", end="", flush=True)
    elif done == steps or done % max(1, steps // 5) == 0:
        print(f"epoch {epoch}: {done}/{steps} steps ({100 * done // steps}%), loss "
              f"{loss:.4f}", flush=True)


@nnx.jit
def train_step(model: Net, optimizer: nnx.Optimizer, x, y):
    """One step; the gradient allreduce runs inside this compiled function."""
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def test_stats(model: Net, x, y):
    """(summed loss, correct predictions) on this rank's test shard."""
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
    return jnp.stack([loss, (logits.argmax(-1) == y).sum().astype(jnp.float32)])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="directory with the MNIST IDX files")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch early (0: no)")
    p.add_argument("--checkpoint-dir", help="rank 0 saves a checkpoint here every epoch")
    args = p.parse_args(argv)

    ddl.init()                                                          # 1. start ddl
    (x_train, y_train), (x_test, y_test), source = mnist_data.load(args.data_dir)
    x_train, x_test = x_train[..., None], x_test[..., None]             # NHWC
    y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
    # each rank trains on its own shard
    x_train, y_train = x_train[ddl.rank()::ddl.size()], y_train[ddl.rank()::ddl.size()]

    model = Net(nnx.Rngs(ddl.rank()))  # different initial weights: the broadcast fixes them
    tx = optax.sgd(args.lr * ddl.size(), momentum=0.5)                  # 2. scale the lr
    optimizer = nnx.Optimizer(model, ddl.DistributedOptimizer(tx),      # 3. wrap
                              wrt=nnx.Param)
    ddl.broadcast_parameters(model, root_rank=0)                        # 4. same start
    ddl.broadcast_parameters(optimizer, root_rank=0, name="optimizer")
    if ddl.rank() == 0:
        print(f"training on {source}: {len(x_train)} examples per rank, {ddl.size()} "
              f"rank(s)", flush=True)

    steps = (len(x_train) + args.batch_size - 1) // args.batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(epoch).permutation(len(x_train))
        start = time.monotonic()
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            loss = train_step(model, optimizer, jnp.asarray(x_train[idx]),
                              jnp.asarray(y_train[idx]))
            if ddl.rank() == 0:
                progress(epoch, step + 1, steps, float(loss))
        if ddl.rank() == 0 and sys.stdout.isatty():
            print()
        # test accuracy and loss, averaged over ranks (each tests its shard)
        xs, ys = x_test[ddl.rank()::ddl.size()], y_test[ddl.rank()::ddl.size()]
        stats = jnp.concatenate([test_stats(model, jnp.asarray(xs), jnp.asarray(ys)),
                                 jnp.array([len(ys)], jnp.float32)])
        total = np.asarray(ddl.allreduce(stats, name="test_stats", op=ddl.Sum))
        if ddl.rank() == 0:
            print(f"epoch {epoch}: {steps} steps in {time.monotonic() - start:.1f} s, "
                  f"test loss {total[0] / total[2]:.4f}, "
                  f"test accuracy {100 * total[1] / total[2]:.1f}%", flush=True)
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
                np.savez(os.path.join(args.checkpoint_dir, f"checkpoint-{epoch}.npz"),
                         **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})
    ddl.shutdown()


if __name__ == "__main__":
    main()
