"""MNIST with MXNet Gluon and ddl.mxnet: the four changes, in the MXNet environment.

    make setup-mxnet
    .venv-mxnet/bin/ddlrun -np 2 .venv-mxnet/bin/python examples/mxnet_mnist.py [--data-dir D]

Reads MNIST from ``--data-dir`` (the IDX files) when given; otherwise it uses a
synthetic MNIST-shaped data set and says so. Only rank 0 writes checkpoints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np

import ddl.mxnet as ddl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist_data  # noqa: E402


def build_net() -> mx.gluon.nn.HybridSequential:
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(16, 3, activation="relu"), mx.gluon.nn.MaxPool2D(2),
            mx.gluon.nn.Flatten(), mx.gluon.nn.Dense(64, activation="relu"),
            mx.gluon.nn.Dense(10))
    return net


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="directory with the MNIST IDX files")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch early (0: no)")
    p.add_argument("--checkpoint-dir", help="rank 0 saves the parameters here every epoch")
    args = p.parse_args(argv)

    ddl.init()                                                          # 1. start ddl
    mx.random.seed(ddl.rank())  # different initial weights: the broadcast fixes them
    (x_train, y_train), (x_test, y_test), source = mnist_data.load(args.data_dir)
    x_train, y_train = x_train[ddl.rank()::ddl.size()], y_train[ddl.rank()::ddl.size()]
    net = build_net()
    net.initialize(mx.init.Xavier())
    ddl.broadcast_parameters(net.collect_params(), root_rank=0)         # 4. same start
    trainer = ddl.DistributedTrainer(net.collect_params(), "sgd",       # 3. wrap
                                     {"learning_rate": args.lr * ddl.size(),  # 2. scale
                                      "momentum": 0.5})
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
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
            data = mx.nd.array(x_train[idx][:, None])
            label = mx.nd.array(y_train[idx])
            with mx.autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(idx))
        xs, ys = x_test[ddl.rank()::ddl.size()], y_test[ddl.rank()::ddl.size()]
        out = net(mx.nd.array(xs[:, None]))
        stats = mx.nd.array([float(loss_fn(out, mx.nd.array(ys)).sum().asscalar()),
                             float((out.argmax(axis=1).asnumpy() == ys).sum()), len(ys)],
                            dtype="float64")
        total = ddl.allreduce(stats, name="test_stats", op=ddl.Sum).asnumpy()
        if ddl.rank() == 0:
            print(f"epoch {epoch}: {steps} steps in {time.monotonic() - start:.1f} s, "
                  f"test loss {total[0] / total[2]:.4f}, "
                  f"test accuracy {100 * total[1] / total[2]:.1f}%", flush=True)
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                net.save_parameters(os.path.join(args.checkpoint_dir,
                                                 f"checkpoint-{epoch}.params"))
    ddl.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
