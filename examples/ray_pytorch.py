"""Data-parallel PyTorch training on Ray with ddl.ray.RayExecutor.

    python examples/ray_pytorch.py                      # a local Ray of this machine
    python examples/ray_pytorch.py --address auto       # an existing Ray cluster

Each of the --num-workers actors is one rank; the model trains on its own shard and the
gradients are averaged by ddl.torch.DistributedOptimizer.
"""

import argparse


def train(epochs: int, lr: float):
    import numpy as np
    import torch
    import ddl.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rng = np.random.default_rng(hvd.rank())  # each rank its own shard
    true_w = np.linspace(-1, 1, 10).astype(np.float32)
    for _ in range(epochs):
        for _ in range(20):
            x = torch.tensor(rng.standard_normal((32, 10)), dtype=torch.float32)
            y = x @ torch.tensor(true_w)[:, None]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    final = hvd.allreduce(loss.detach(), name="final_loss")  # averaged over the ranks
    return {"rank": hvd.rank(), "loss": float(final)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args()
    import ray
    from ddl.ray import RayExecutor
    if args.address:
        ray.init(address=args.address)
    else:  # a new local Ray, even where another runs
        ray.init(address="local", num_cpus=args.num_workers, include_dashboard=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60),
                           num_workers=args.num_workers, cpus_per_worker=1)
    executor.start()
    try:
        results = executor.run(train, args=(args.epochs, 0.01))
    finally:
        executor.shutdown()
        ray.shutdown()
    for r in results:
        print(f"rank {r['rank']}: final loss (mean over ranks) {r['loss']:.4f}")
    assert len({r["loss"] for r in results}) == 1
    print("OK")


if __name__ == "__main__":
    main()
