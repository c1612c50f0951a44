"""Training throughput of ddl.jax on synthetic data, the way Horovod's benchmark measures it.

    ddlrun -np 2 python examples/jax_synthetic_benchmark.py [--compare jax] [--allreduce-only]

Each rank trains a model on random MNIST-shaped batches (no data loading) with a
``jax.jit``-compiled step whose gradients ``ddl.jax.DistributedOptimizer`` averages (one
fused allreduce inside the compiled step): ``--num-warmup-batches`` untimed batches, then
``--num-iters`` timed iterations of ``--num-batches-per-iter`` batches each. It prints
images/s per rank and in total (the median over the iterations, +- 1.96 standard
deviations).

``--compare jax`` also trains the same model, from the same initial weights, with JAX's
own multi-process collectives, in the same processes: ``jax.distributed`` over Gloo (one
CPU device per process), a ``jax.shard_map`` data-parallel step over a one-axis mesh whose
gradients are averaged with ``lax.pmean``. The two alternate ``--rounds`` times (both see
the same machine; alternating cancels drift) and it prints both and the ratio ddl / jax
(above 1: ddl is faster).

``--allreduce-only`` times a float32 allreduce inside ``jax.jit`` instead (``--sizes``, in
bytes): ``ddl.jax.allreduce`` and, with ``--compare jax``, ``lax.psum`` in ``shard_map``,
alternating, and prints an nccl-tests-style table (median time, algbw, busbw =
algbw * 2 (n - 1) / n) and the ratio ddl / jax of the speeds.

The default model is a 784-W-W/4-10 MLP with W = ``--width`` (1024: 1.07 M parameters);
``--model cnn`` is a small convolutional network.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ddl.jax as ddl


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--width", type=int, default=1024,
                   help="MLP hidden width (model size); the CNN's dense layer is width/8")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--bf16-allreduce", action="store_true",
                   help="compress gradients to bfloat16 on the wire (ddl only)")
    p.add_argument("--compare", choices=["jax"],
                   help="also run JAX's own collectives (jax.distributed over Gloo)")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --compare: alternate ddl and JAX this many times")
    p.add_argument("--allreduce-only", action="store_true",
                   help="time an allreduce inside jax.jit instead of training")
    p.add_argument("--sizes", default="4,65536,1048576,16777216",
                   help="with --allreduce-only: message sizes in bytes")
    p.add_argument("--iters", type=int, default=20,
                   help="with --allreduce-only: timed calls per size and round")
    return p.parse_args(argv)


def log(text: str) -> None:
    if ddl.rank() == 0:
        print(text, flush=True)


# -- the model ------------------------------------------------------------------------------

def init_params(kind: str, width: int, key) -> dict:
    def dense(k, n_in, n_out):
        return {"w": jax.random.normal(k, (n_in, n_out), jnp.float32) * (2 / n_in) ** 0.5,
                "b": jnp.zeros((n_out,), jnp.float32)}
    keys = jax.random.split(key, 4)
    if kind == "mlp":
        return {"fc1": dense(keys[0], 784, width), "fc2": dense(keys[1], width, width // 4),
                "fc3": dense(keys[2], width // 4, 10)}
    conv = lambda k, c_in, c_out: {  # noqa: E731
        "w": jax.random.normal(k, (3, 3, c_in, c_out), jnp.float32) * (2 / (9 * c_in)) ** 0.5,
        "b": jnp.zeros((c_out,), jnp.float32)}
    return {"conv1": conv(keys[0], 1, 16), "conv2": conv(keys[1], 16, 32),
            "fc1": dense(keys[2], 12 * 12 * 32, max(16, width // 8)),
            "fc2": dense(keys[3], max(16, width // 8), 10)}


def forward(params: dict, x):
    if "conv1" in params:
        x = x.reshape(x.shape[0], 28, 28, 1)
        for layer in ("conv1", "conv2"):
            x = jax.lax.conv_general_dilated(x, params[layer]["w"], (1, 1), "VALID",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.nn.relu(x + params[layer]["b"])
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                  "VALID")
        x = x.reshape(x.shape[0], -1)
        x = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
        return x @ params["fc2"]["w"] + params["fc2"]["b"]
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
    x = jax.nn.relu(x @ params["fc2"]["w"] + params["fc2"]["b"])
    return x @ params["fc3"]["w"] + params["fc3"]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()


# -- the two training paths -----------------------------------------------------------------

def ddl_trainer(params, args):
    """ddl.jax: DistributedOptimizer's allreduce inside the jitted step."""
    compression = ddl.Compression.bf16 if args.bf16_allreduce else ddl.Compression.none
    tx = ddl.DistributedOptimizer(optax.sgd(0.01 * ddl.size()), compression=compression)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, [params, tx.init(params)]


def jax_trainer(params, args, mesh):
    """JAX's own path: shard_map over the processes' devices, lax.pmean of the gradients."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    tx = optax.sgd(0.01 * ddl.size())

    def local_step(params, opt_state, x, y):
        grads = jax.lax.pmean(jax.grad(loss_fn)(params, x, y), "d")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                 out_specs=(P(), P())))
    replicated = NamedSharding(mesh, P())

    def to_global(tree):
        return jax.tree_util.tree_map(
            lambda v: jax.make_array_from_single_device_arrays(v.shape, replicated, [v]),
            tree)
    return step, [to_global(params), to_global(tx.init(params))]


def global_batch(mesh, *local):
    """Global arrays, sharded along dim 0 over the processes, from each one's batch."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    sharding = NamedSharding(mesh, P("d"))
    return [jax.make_array_from_single_device_arrays((ddl.size() * v.shape[0],) + v.shape[1:],
                                                     sharding, [v]) for v in local]


def measure(step, state, data, args) -> np.ndarray:
    """Images/s of this rank, one value per timed iteration; ``state`` is updated."""
    def batches(n):
        for _ in range(n):
            state[:] = step(*state, *data)
        jax.block_until_ready(state)

    batches(args.num_warmup_batches)
    rates = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        batches(args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t0))
    return np.array(rates)


def report(label: str, rates: np.ndarray) -> float:
    """Print per-rank and total images/s: the median over the timed iterations, +- 1.96
    standard deviations (the slowest rank's median decides the total)."""
    every = np.asarray(ddl.allgather(jnp.array([[np.median(rates), rates.std()]],
                                               jnp.float32), name=f"bench/{label}"))
    slowest = int(every[:, 0].argmin())
    median, std = float(every[slowest, 0]), float(every[slowest, 1])
    n = ddl.size()
    log(f"{label}: img/sec per rank: {median:.1f} +-{1.96 * std:.1f}")
    log(f"{label}: total img/sec on {n} rank(s): {n * median:.1f} +-{1.96 * std * n:.1f}")
    return n * median


# -- allreduce only -------------------------------------------------------------------------

def _median_s(fn, x, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def allreduce_table(args, mesh) -> None:
    from jax.sharding import PartitionSpec as P
    n = ddl.size()
    runs = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = max(1, nbytes // 4)
        x = jnp.full((count,), float(ddl.rank() + 1), jnp.float32)
        fns = {"ddl": (jax.jit(lambda v, k=nbytes: ddl.allreduce(v, name=f"bench/ar{k}",
                                                                  op=ddl.Sum)), x)}
        if mesh is not None:
            psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
                                         in_specs=P("d"), out_specs=P()))
            fns["jax"] = (psum, global_batch(mesh, x)[0])
        times = {label: [] for label in fns}
        for label, (fn, arg) in fns.items():  # compile and warm up; check the sum
            out = np.asarray(jax.block_until_ready(fn(arg)))
            assert out.shape == (count,) and out[0] == n * (n + 1) / 2, (label, out[:4])
        for _ in range(args.rounds):
            for label, (fn, arg) in fns.items():
                times[label].append(_median_s(fn, arg, args.iters))
        runs[count * 4] = {label: statistics.median(t) for label, t in times.items()}
    # every rank measured; rank 0's medians are reported (both ranks wait for each other)
    log(f"allreduce inside jax.jit, float32, {n} rank(s), median of {args.rounds} rounds "
        f"x {args.iters} calls")
    head = f"{'size (B)':>10} {'ddl us':>10} {'algbw GB/s':>10} {'busbw GB/s':>10}"
    if mesh is not None:
        head += f" {'jax us':>10} {'algbw GB/s':>10} {'busbw GB/s':>10} {'ddl/jax':>8}"
    log(head)
    for nbytes, t in runs.items():
        line = f"{nbytes:>10}"
        for label in t:
            algbw = nbytes / t[label] / 1e9
            line += f" {t[label] * 1e6:>10.1f} {algbw:>10.3f} {algbw * 2 * (n - 1) / n:>10.3f}"
        if "jax" in t:
            line += f" {t['jax'] / t['ddl']:>8.2f}"
        log(line)


# -- main -----------------------------------------------------------------------------------

def start_jax_distributed():
    """JAX's own multi-process runtime over Gloo, one CPU device per process; must run
    before any JAX array exists. Returns the one-axis mesh over the processes."""
    from jax.sharding import Mesh
    port = ddl.broadcast_object(_free_port() if ddl.rank() == 0 else 0, root_rank=0,
                                name="bench/port")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=ddl.size(),
                               process_id=ddl.rank())
    assert len(jax.devices()) == ddl.size() and len(jax.local_devices()) == 1, jax.devices()
    return Mesh(np.array(jax.devices()), ("d",))


def main(argv=None) -> None:
    args = parse_args(argv)
    ddl.init()
    mesh = start_jax_distributed() if args.compare == "jax" else None
    if args.allreduce_only:
        allreduce_table(args, mesh)
    else:
        train(args, mesh)
    if mesh is not None:
        jax.distributed.shutdown()
    ddl.shutdown()


def train(args, mesh) -> None:
    device = jax.local_devices()[0]
    with jax.default_device(device):
        params = init_params(args.model, args.width, jax.random.key(ddl.rank()))
        params = ddl.broadcast_parameters(params, root_rank=0)  # same start on every rank
        rng = np.random.default_rng(ddl.rank())
        data = (jnp.asarray(rng.standard_normal((args.batch_size, 784), np.float32)),
                jnp.asarray(rng.integers(0, 10, args.batch_size).astype(np.int32)))
    count = sum(v.size for v in jax.tree_util.tree_leaves(params))
    log(f"model: {args.model}, {count / 1e6:.2f} M parameters; batch size {args.batch_size} "
        f"per rank; {ddl.size()} rank(s)")
    runs = {"ddl": (*ddl_trainer(params, args), data)}
    if mesh is not None:
        runs["jax"] = (*jax_trainer(params, args, mesh), global_batch(mesh, *data))
    # with --compare, the two alternate --rounds times, so that both see the same machine
    rates = {label: [] for label in runs}
    for _ in range(args.rounds if len(runs) > 1 else 1):
        for label, (step, state, batch) in runs.items():
            rates[label].append(measure(step, state, batch, args))
    totals = {label: report(label, np.concatenate(r)) for label, r in rates.items()}
    if "jax" in totals:
        log(f"ddl / jax: {totals['ddl'] / totals['jax']:.2f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
