"""Training throughput of ddl.tensorflow on synthetic data (tf_cnn_benchmarks' synthetic
mode): images/s per rank and in total.

    ddlrun -np 2 python examples/tensorflow2_synthetic_benchmark.py [--model cnn|mlp]

Each rank trains a Keras model on one random batch, repeated, with a
``DistributedGradientTape`` step in a ``tf.function``: ``--num-warmup-batches`` untimed
steps, then ``--num-iters`` timed iterations of ``--num-batches-per-iter`` steps.
"""

from __future__ import annotations

import argparse
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as ddl  # noqa: E402


def build_model(kind: str) -> keras.Model:
    if kind == "mlp":
        return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                                 keras.layers.Dense(1024, activation="relu"),
                                 keras.layers.Dense(256, activation="relu"),
                                 keras.layers.Dense(10)])
    return keras.Sequential([keras.Input((28, 28, 1)),
                             keras.layers.Conv2D(32, 3, activation="relu"),
                             keras.layers.Conv2D(64, 3, activation="relu"),
                             keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                             keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(10)])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--no-reduce", action="store_true",
                   help="skip the gradient reduction: the compute-only upper bound")
    p.add_argument("--intra-op-threads", type=int, default=None,
                   help="TensorFlow's intra-op threads (default: this host's cores "
                        "shared among its ranks)")
    args = p.parse_args(argv)

    ddl.init()
    threads = args.intra_op_threads or max(1, (os.cpu_count() or 1) // ddl.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    keras.utils.set_random_seed(0)
    model = build_model(args.model)
    opt = keras.optimizers.SGD(0.01 * ddl.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.random.uniform([args.batch_size, 28, 28, 1])
    target = tf.random.uniform([args.batch_size], maxval=10, dtype=tf.int64)
    compression = ddl.Compression.fp16 if args.fp16_allreduce else ddl.Compression.none

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        if not args.no_reduce:
            tape = ddl.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            ddl.broadcast_variables(model.variables, root_rank=0)
            ddl.broadcast_variables(opt.variables, root_rank=0)

    log = print if ddl.rank() == 0 else (lambda *a, **k: None)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log(f"model: {args.model}, {params / 1e6:.2f} M parameters; batch size "
        f"{args.batch_size} per rank; {ddl.size()} rank(s); {threads} intra-op "
        f"thread(s){'; no gradient reduction' if args.no_reduce else ''}", flush=True)
    step(True)
    timeit.timeit(lambda: step(False), number=args.num_warmup_batches)
    rates = []
    for _ in range(args.num_iters):
        t = timeit.timeit(lambda: step(False), number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / t)
    every = ddl.allgather_object(float(np.mean(rates)))
    per_rank = min(every)
    log(f"img/sec per rank: {per_rank:.1f} +-{1.96 * np.std(rates):.1f}")
    log(f"total img/sec on {ddl.size()} rank(s): {per_rank * ddl.size():.1f}", flush=True)
    ddl.shutdown()


if __name__ == "__main__":
    main()
