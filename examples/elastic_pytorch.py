"""Elastic training with PyTorch: a small regression on synthetic data that carries on when
workers come and go.

    ddlrun --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/elastic_pytorch.py          # elastic
    ddlrun -np 2 python examples/elastic_pytorch.py     # fixed world
    python examples/elastic_pytorch.py                  # one process

What makes it elastic: ``ElasticSampler`` shards the data over the current world and
remembers which samples an epoch has trained; ``TorchState`` holds the model, the
optimizer, the sampler and the counters, and ``state.commit()`` every ``--commit-every``
batches saves them (the point a failure rolls back to) and lets ddlrun add workers; the
learning rate follows the world's size in a reset callback; ``ddl.elastic.run`` forms a new
world after a change and calls ``train`` again. Without elastic it syncs once and trains.

Rank 0 ends with ``done: E epochs, world sizes [..], samples S, checksum C``: the size of
every world that trained (in order), the samples trained and kept (rolled-back batches do
not count: with every sample of every epoch trained exactly once, S = E * --samples), and
the sum of the model's parameters.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import ddl.torch as ddl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=100, help="size of the data set")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--commit-every", type=int, default=4, help="batches between commits")
    p.add_argument("--lr", type=float, default=0.01, help="per rank (scaled by size)")
    p.add_argument("--sleep", type=float, default=0.0,
                   help="seconds to wait after each batch (to watch workers come and go)")
    args = p.parse_args()

    ddl.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((args.samples, 8)), dtype=torch.float32)
    y = x @ torch.linspace(-1.0, 1.0, 8).reshape(8, 1) + 0.1 * torch.tensor(
        rng.standard_normal((args.samples, 1)), dtype=torch.float32)
    dataset = torch.utils.data.TensorDataset(x, y)

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * ddl.size(), momentum=0.9)
    opt = ddl.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = ddl.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size,
                                         sampler=sampler)

    state = ddl.elastic.TorchState(model, opt, sampler=sampler, epoch=0, samples=0,
                                   sizes=[])

    def on_reset() -> None:  # after every change of workers, before the sync
        for group in opt.param_groups:
            group["lr"] = args.lr * ddl.size()

    state.register_reset_callbacks([on_reset])

    @ddl.elastic.run
    def train(state) -> None:
        state.sizes = state.sizes + [ddl.size()]
        state.commit()
        while state.epoch < args.epochs:
            loss = torch.zeros(())
            for batch_idx, (xb, yb) in enumerate(loader):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                opt.step()
                trained = ddl.allreduce(torch.tensor([len(xb)]), op=ddl.Sum,
                                        name="samples")
                state.samples += int(trained)
                state.sampler.record_batch(batch_idx, args.batch_size)
                if (batch_idx + 1) % args.commit_every == 0:
                    state.commit()
                if args.sleep:
                    time.sleep(args.sleep)
            ddl.join()  # the ranks' shares may differ by one sample: see ElasticSampler
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            if ddl.rank() == 0:
                print(f"epoch {state.epoch}: last loss {float(loss.detach()):.4f} on "
                      f"{ddl.size()} rank(s)", flush=True)
            state.commit()

    train(state)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    if ddl.rank() == 0:
        sizes = ", ".join(str(s) for s in state.sizes)
        print(f"done: {state.epoch} epochs, world sizes [{sizes}], samples {state.samples}, "
              f"checksum {checksum:.6e}", flush=True)
    ddl.shutdown()


if __name__ == "__main__":
    main()
