"""Training throughput of ddl.torch on synthetic data, the way Horovod's benchmark measures it.

    ddlrun -np 2 python examples/pytorch_synthetic_benchmark.py [--compare ddp,local,alone]
           [--device cuda]

Each rank trains a model on random MNIST-shaped batches (no data loading) with
``ddl.torch.DistributedOptimizer``: ``--num-warmup-batches`` untimed batches, then
``--num-iters`` timed iterations of ``--num-batches-per-iter`` batches each. It prints
images/s per rank and in total (mean ± 1.96 standard deviations over the iterations).

``--compare`` (a comma-separated list) also trains the same model, from the same initial
weights, in the same processes, alternating with ddl ``--rounds`` times so that every run
sees the same machine, and prints each and ddl's ratio to it:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on torch.distributed's Gloo
  backend, the peer a torch user would pick;
- ``local``: every rank trains its own copy with the plain optimizer and exchanges
  nothing, all ranks at once: the ceiling of any data-parallel scheme on these ranks
  (what they compute when communication costs nothing);
- ``alone``: rank 0 trains with the plain optimizer while the other ranks wait idle, so
  its images/s is one process's on this machine: ddl's total over it is the speed-up
  over one process.

The default model is a 784-1024-256-10 MLP (1.07 M parameters); ``--model cnn`` is a
small convolutional network. ``--threads`` sets torch's intra-op threads per process
(default 1: ranks share the host's cores). ``--device cuda`` trains on GPU
``local_rank % device_count`` (ranks may share a GPU), each timed block ending when the
GPU has finished it; DDP then runs on the same GPU over Gloo.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import socket
import time

import numpy as np
import torch
import torch.nn.functional as F

import ddl.torch as ddl


def build_model(kind: str) -> torch.nn.Module:
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1024),
                                   torch.nn.ReLU(), torch.nn.Linear(1024, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(),
                               torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(9216, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to float16 on the wire")
    p.add_argument("--compare", type=_baselines, default=[],
                   help="also run, alternating with ddl: a comma-separated list of "
                        f"{', '.join(BASELINES)} (see above)")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --compare: alternate ddl and the baselines this many times")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model trains (cuda: GPU local_rank %% device_count)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    return args


BASELINES = ("ddp", "local", "alone")


def _baselines(text: str) -> list:
    names = [n for n in text.split(",") if n]
    wrong = [n for n in names if n not in BASELINES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"unknown baseline {', '.join(wrong) or repr(text)}: choose from "
            f"{', '.join(BASELINES)}, comma-separated")
    return list(dict.fromkeys(names))


def pick_device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", ddl.local_rank() % torch.cuda.device_count())


def log(text: str) -> None:
    if ddl.rank() == 0:
        print(text, flush=True)


def measure(model, optimizer, data, target, args) -> np.ndarray:
    """Images/s of this rank, one value per timed iteration."""
    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def block(steps: int) -> float:  # seconds, until the device has done them too
        gc.disable()  # as timeit does
        try:
            start = time.perf_counter()
            for _ in range(steps):
                benchmark_step()
            if data.is_cuda:
                torch.cuda.synchronize(data.device)
            return time.perf_counter() - start
        finally:
            gc.enable()

    block(args.num_warmup_batches)
    rates = []
    for _ in range(args.num_iters):
        t = block(args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / t)
    return np.array(rates)


def report(label: str, rates: np.ndarray) -> float:
    """Print per-rank and total images/s (the slowest rank's mean decides the total)."""
    every = ddl.allgather(torch.tensor([rates.mean(), rates.std()], dtype=torch.float64)
                          .reshape(1, 2), name=f"bench/{label}")
    mean, std = every[:, 0].min().item(), every[every[:, 0].argmin(), 1].item()
    n = ddl.size()
    log(f"{label}: img/sec per rank: {mean:.1f} +-{1.96 * std:.1f}")
    log(f"{label}: total img/sec on {n} rank(s): {n * mean:.1f} +-{1.96 * std * n:.1f}")
    return n * mean


def report_alone(rates: np.ndarray) -> float:
    """Print rank 0's images/s alone (the other ranks measured nothing)."""
    mine = [rates.mean(), rates.std()] if ddl.rank() == 0 else [0.0, 0.0]
    mean, std = ddl.broadcast(torch.tensor(mine, dtype=torch.float64), root_rank=0,
                              name="bench/alone").tolist()
    log(f"alone: img/sec of one process: {mean:.1f} +-{1.96 * std:.1f}")
    return mean


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ddl.init()
    torch.manual_seed(0)
    device = pick_device(args.device)
    model = build_model(args.model).to(device)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    data = torch.randn(args.batch_size, 1, 28, 28, device=device)
    target = torch.randint(0, 10, (args.batch_size,), device=device)
    log(f"model: {args.model}, {params / 1e6:.2f} M parameters; batch size {args.batch_size} "
        f"per rank; {ddl.size()} rank(s), {args.threads} thread(s) each, on {device.type}")

    opt = torch.optim.SGD(model.parameters(), lr=0.01 * ddl.size())
    compression = ddl.Compression.fp16 if args.fp16_allreduce else ddl.Compression.none
    opt = ddl.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    ddl.broadcast_parameters(model.state_dict(), root_rank=0)
    ddl.broadcast_optimizer_state(opt, root_rank=0)
    runs = {"ddl": (model, opt)}
    if "ddp" in args.compare:
        import torch.distributed as dist
        port = torch.tensor([_free_port() if ddl.rank() == 0 else 0])
        port = int(ddl.broadcast(port, root_rank=0, name="bench/port").item())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=ddl.rank(), world_size=ddl.size(),
                                timeout=datetime.timedelta(seconds=300))
        baseline = build_model(args.model).to(device)
        baseline.load_state_dict(initial)
        ddp = torch.nn.parallel.DistributedDataParallel(
            baseline, device_ids=[device] if device.type == "cuda" else None)
        runs["ddp"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01 * ddl.size()))
    for label in ("local", "alone"):
        if label in args.compare:  # the plain model and optimizer: nothing is exchanged
            plain = build_model(args.model).to(device)
            plain.load_state_dict(initial)
            runs[label] = (plain, torch.optim.SGD(plain.parameters(), lr=0.01))
    # with --compare, the runs alternate --rounds times, so that all see the same machine
    rates = {label: [] for label in runs}
    for _ in range(args.rounds if len(runs) > 1 else 1):
        for label, (m, o) in runs.items():
            if label != "alone" or ddl.rank() == 0:
                rates[label].append(measure(m, o, data, target, args))
            if label == "alone":  # the others wait idle until rank 0 has measured
                ddl.barrier()
    totals = {label: report_alone(np.concatenate(r) if r else np.zeros(1))
              if label == "alone" else report(label, np.concatenate(r))
              for label, r in rates.items()}
    for label in args.compare:
        log(f"ddl / {label}: {totals['ddl'] / totals[label]:.2f}")
    if "ddp" in totals:
        import torch.distributed as dist
        dist.destroy_process_group()
    ddl.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
