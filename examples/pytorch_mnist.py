"""Train a small CNN on MNIST with ddl.torch: the four changes of a distributed script.

    ddlrun -np 2 python examples/pytorch_mnist.py [--data-dir DIR] [--epochs 2]

With ``--data-dir`` it reads MNIST from the four IDX files there (``train-images-idx3-
ubyte``, ``train-labels-idx1-ubyte``, ``t10k-...``, optionally gzipped); without, it uses a
synthetic MNIST-shaped data set (and says so): random images whose label is encoded in
their brightness pattern, so the model still has something to learn. Each rank trains on
its own shard of the data. Only rank 0 prints metrics and the progress display and saves
checkpoints (``--checkpoint-dir``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import ddl.torch as ddl
import mnist_data


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5)
        self.conv2 = torch.nn.Conv2d(16, 32, 5)
        self.fc1 = torch.nn.Linear(512, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def progress(epoch: int, done: int, steps: int, loss: float) -> None:
    """A progress bar on a terminal; under ddlrun (a pipe), a line every fifth."""
    if sys.stdout.isatty():
        bar = done * 30 // steps
        print(f"\repoch {epoch} [{'=' * bar}{' ' * (30 - bar)}] {done}/{steps} "
              f"loss {loss:.4f}", end="", flush=True)
    elif done == steps or done % max(1, steps // 5) == 0:
        print(f"epoch {epoch}: {done}/{steps} steps ({100 * done // steps}%), loss "
              f"{loss:.4f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="directory with the MNIST IDX files")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch early (0: no)")
    p.add_argument("--checkpoint-dir", help="rank 0 saves a checkpoint here every epoch")
    args = p.parse_args(argv)

    ddl.init()                                                       # 1. start ddl
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test), source = mnist_data.load(args.data_dir)
    x_train, x_test = (torch.from_numpy(x).unsqueeze(1) for x in (x_train, x_test))
    y_train, y_test = torch.from_numpy(y_train), torch.from_numpy(y_test)
    # each rank trains on its own shard
    x_train, y_train = x_train[ddl.rank()::ddl.size()], y_train[ddl.rank()::ddl.size()]

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * ddl.size(),  # 2. scale the lr
                          momentum=0.5)
    opt = ddl.DistributedOptimizer(opt, named_parameters=model.named_parameters())  # 3.
    ddl.broadcast_parameters(model.state_dict(), root_rank=0)        # 4. same start
    ddl.broadcast_optimizer_state(opt, root_rank=0)
    if ddl.rank() == 0:
        print(f"training on {source}: {len(x_train)} examples per rank, {ddl.size()} "
              f"rank(s)", flush=True)

    steps = (len(x_train) + args.batch_size - 1) // args.batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        start = time.monotonic()
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            if ddl.rank() == 0:
                progress(epoch, step + 1, steps, loss.item())
        if ddl.rank() == 0 and sys.stdout.isatty():
            print()
        # test accuracy and loss, averaged over ranks (each tests its shard)
        model.eval()
        with torch.no_grad():
            xs, ys = x_test[ddl.rank()::ddl.size()], y_test[ddl.rank()::ddl.size()]
            out = model(xs)
            stats = torch.tensor([F.cross_entropy(out, ys, reduction="sum").item(),
                                  (out.argmax(1) == ys).sum().item(), len(ys)],
                                 dtype=torch.float64)
        total = ddl.allreduce(stats, name="test_stats", op=ddl.Sum)
        if ddl.rank() == 0:
            print(f"epoch {epoch}: {steps} steps in {time.monotonic() - start:.1f} s, "
                  f"test loss {total[0] / total[2]:.4f}, "
                  f"test accuracy {100 * total[1] / total[2]:.1f}%", flush=True)
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                torch.save({"epoch": epoch, "model": model.state_dict(),
                            "optimizer": opt.state_dict()},
                           os.path.join(args.checkpoint_dir, f"checkpoint-{epoch}.pt"))
    ddl.shutdown()


if __name__ == "__main__":
    main()
