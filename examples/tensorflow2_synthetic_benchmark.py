"""Training throughput of ddl.tensorflow on synthetic data (tf_cnn_benchmarks' synthetic
mode): images/s per rank and in total.

    ddlrun -np 2 python examples/tensorflow2_synthetic_benchmark.py [--model cnn|mlp]
        [--compare mwms]
    ddlrun -np 2 python examples/tensorflow2_synthetic_benchmark.py --model ResNet50 \
        --image-size 32 --scaling

``--model`` also takes the models of tf_cnn_benchmarks from ``keras.applications``
(``ResNet50``, ``InceptionV3``, ``VGG16``, ``MobileNetV2``; random weights,
``--image-size`` pixels, 1000 classes; InceptionV3 needs at least 75). ``--scaling`` first times rank 0 training alone
(the other ranks wait), then every rank together, and prints the scaling efficiency:
total images/s over (ranks x images/s of one rank alone).

Each rank trains a Keras model on one random batch, repeated, with a
``DistributedGradientTape`` step in a ``tf.function``: ``--num-warmup-batches`` untimed
steps, then ``--num-iters`` timed iterations of ``--num-batches-per-iter`` steps. It
prints images/s per rank and in total (mean ± 1.96 standard deviations over the
iterations; the slowest rank decides).

``--compare mwms`` then trains the same model, from the same seed and with the same
per-rank batch and step counts, with TensorFlow's own
``tf.distribute.MultiWorkerMirroredStrategy`` (RING collectives over gRPC, CPU), and
prints both and their ratio. TensorFlow only lets a process enable collective ops
before it runs its first op ("Collective ops must be configured at program startup"),
so each rank measures MWMS in a fresh child process of its own, started with the rank's
environment plus a ``TF_CONFIG`` built at run time: every rank picks a free loopback
port and the ranks exchange them with ``ddl.allgather_object``. A child that has not
finished its first step within ``--mwms-timeout`` seconds is killed (so is one that
trains far longer than ddl did); rank 0 then says why and the job exits non-zero.
MWMS always reduces in float32.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as ddl  # noqa: E402

_STARTED = "mwms-started"  # what a MWMS child prints once its first step is done
_RESULT = "mwms-rates: "  # ... and then its images/s


APPLICATIONS = ("ResNet50", "InceptionV3", "VGG16", "MobileNetV2")


def input_shape(args) -> tuple:
    if args.model in APPLICATIONS:
        return (args.image_size, args.image_size, 3)
    return (28, 28, 1)


def classes(args) -> int:
    return 1000 if args.model in APPLICATIONS else 10


def build_model(kind: str, image_size: int = 224) -> keras.Model:
    if kind in APPLICATIONS:
        return getattr(keras.applications, kind)(
            weights=None, input_shape=(image_size, image_size, 3), classes=1000,
            classifier_activation=None)
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "mlp", *APPLICATIONS], default="cnn")
    p.add_argument("--image-size", type=int, default=32,
                   help="pixels per side for the keras.applications models")
    p.add_argument("--scaling", action="store_true",
                   help="also time rank 0 alone first and print the scaling efficiency")
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
    p.add_argument("--compare", choices=["mwms"],
                   help="also run tf.distribute.MultiWorkerMirroredStrategy")
    p.add_argument("--mwms-timeout", type=float, default=60.0,
                   help="with --compare: seconds a rank's MWMS worker may take to start "
                        "(import TensorFlow, connect, first step), and each of its "
                        "collectives to finish")
    # set on the MWMS child process a rank starts; TF_CONFIG says which worker it is
    p.add_argument("--mwms-worker", type=int, metavar="RANK_PID", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compare and args.no_reduce:
        p.error("--compare needs the gradient reduction (drop --no-reduce)")
    return args


def timed_rates(step, args) -> list:
    """Images/s of this rank, one value per timed iteration."""
    timeit.timeit(step, number=args.num_warmup_batches)
    rates = []
    for _ in range(args.num_iters):
        t = timeit.timeit(step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / t)
    return rates


def measure_ddl(args, alone: bool = False) -> list:
    """This rank's images/s training with ddl; ``alone``: without any reduction (rank 0
    by itself, for the scaling baseline)."""
    keras.backend.clear_session()  # names start over: every rank's variables named alike
    keras.utils.set_random_seed(0)
    model = build_model(args.model, args.image_size)
    opt = keras.optimizers.SGD(0.01 * ddl.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.random.uniform([args.batch_size, *input_shape(args)])
    target = tf.random.uniform([args.batch_size], maxval=classes(args), dtype=tf.int64)
    reduce = not (args.no_reduce or alone)
    compression = ddl.Compression.fp16 if args.fp16_allreduce else ddl.Compression.none

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        if reduce:
            tape = ddl.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch and reduce:
            ddl.broadcast_variables(model.variables, root_rank=0)
            ddl.broadcast_variables(opt.variables, root_rank=0)

    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if alone:
        step(True)
        return timed_rates(lambda: step(False), args)
    log(f"model: {args.model}, {params / 1e6:.2f} M parameters; batch size "
        f"{args.batch_size} per rank; {ddl.size()} rank(s); {args.intra_op_threads} "
        f"intra-op thread(s){'; no gradient reduction' if args.no_reduce else ''}")
    step(True)
    return timed_rates(lambda: step(False), args)


def report(label: str, rates) -> float:
    """Print per-rank and total images/s (the slowest rank's mean decides the total)."""
    every = ddl.allgather_object((float(np.mean(rates)), float(np.std(rates))),
                                 name=f"bench/{label}")
    mean, std = min(every)
    n = ddl.size()
    log(f"{label}: img/sec per rank: {mean:.1f} +-{1.96 * std:.1f}")
    log(f"{label}: total img/sec on {n} rank(s): {n * mean:.1f} +-{1.96 * std * n:.1f}")
    return n * mean


def log(text: str) -> None:
    if ddl.rank() == 0:
        print(text, flush=True)


def measure_mwms(args, ddl_seconds: float) -> tuple:
    """Run this rank's MWMS worker in a child process: (rates, None) or (None, why)."""
    port = _free_port()
    ports = ddl.allgather_object(port, name="bench/mwms-ports")
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                 "task": {"type": "worker", "index": ddl.rank()}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config))
    cmd = [sys.executable, os.path.abspath(__file__), "--mwms-worker", str(os.getpid()),
           "--model", args.model, "--batch-size", str(args.batch_size),
           "--num-warmup-batches", str(args.num_warmup_batches),
           "--num-batches-per-iter", str(args.num_batches_per_iter),
           "--num-iters", str(args.num_iters),
           "--intra-op-threads", str(args.intra_op_threads),
           "--mwms-timeout", str(args.mwms_timeout)]
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    # the deadlines are kept here, not in the child: while MWMS waits for its peers,
    # TensorFlow holds the child's GIL, so no thread of the child's own can time it out
    lines = queue.Queue()
    errors = collections.deque(maxlen=15)
    readers = [threading.Thread(target=_pump, args=(child.stdout, lines.put), daemon=True),
               threading.Thread(target=_pump, args=(child.stderr, errors.append),
                                daemon=True)]
    for t in readers:
        t.start()
    t0 = time.monotonic()
    started = t0 + args.mwms_timeout  # starting: importing TensorFlow, MWMS, first step
    finished = started + 60 + 20 * ddl_seconds  # training: up to 20x as long as ddl took
    why, grace = None, 30.0  # grace: for the worker to exit once it has said all
    for marker, deadline, step in ((_STARTED, started, "start"),
                                   (_RESULT, finished, "finish")):
        line = _next_line(lines, marker, deadline)
        if line is None:
            if time.monotonic() >= deadline:
                why, grace = (f"the MWMS worker did not {step} within "
                              f"{deadline - t0:.3g} s; killed it"), 0.0
            else:
                why, grace = f"the MWMS worker exited before it could {step}", 10.0
            break
    try:  # (one that has reported may still hang in TensorFlow's shutdown)
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=30)
    if why and grace:
        why += f" (status {child.returncode})"
    for t in readers:
        t.join(timeout=5)
    if why:
        return None, why + "".join(f"\n  {e.rstrip()}" for e in errors
                                   if e and "InitializeLog" not in e)
    return json.loads(line[len(_RESULT):]), None


def _pump(stream, sink) -> None:
    for line in stream:
        sink(line)
    sink(None)


def _next_line(lines: queue.Queue, marker: str, deadline: float):
    """The child's next stdout line starting with ``marker``; None at EOF or deadline."""
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            lines.put(None)  # (EOF stays EOF for the next caller)
            return None
        if line.startswith(marker):
            return line


def mwms_worker(args) -> None:
    """The MWMS child: TF_CONFIG is set, and no TensorFlow op has run in this process."""
    _die_with(args.mwms_worker)
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=args.mwms_timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build_model(args.model, args.image_size)  # (MWMS broadcasts worker 0's)
        opt = keras.optimizers.SGD(0.01 * n)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction="none")
    data = tf.random.uniform([args.batch_size, *input_shape(args)])
    target = tf.random.uniform([args.batch_size], maxval=classes(args), dtype=tf.int64)

    def replica_step():
        with tf.GradientTape() as tape:
            per_example = loss_fn(target, model(data, training=True))
            # the mean over the global batch: the optimizer sums the replicas' gradients
            loss = tf.nn.compute_average_loss(per_example,
                                              global_batch_size=args.batch_size * n)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step():
        strategy.run(replica_step)

    step()
    print(_STARTED, flush=True)
    rates = timed_rates(step, args)
    print(_RESULT + json.dumps(rates), flush=True)


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent (the rank) dies; exit now if it has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mwms_worker is not None:
        return mwms_worker(args)
    ddl.init()
    if not args.intra_op_threads:
        args.intra_op_threads = max(1, (os.cpu_count() or 1) // ddl.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    alone = None
    if args.scaling:  # rank 0 by itself first, the others waiting
        if ddl.rank() == 0:
            alone = float(np.mean(measure_ddl(args, alone=True)))
        alone = ddl.broadcast_object(alone, root_rank=0, name="bench/alone")
    began = time.monotonic()
    rates = {"ddl": measure_ddl(args)}
    if args.compare == "mwms":
        ddl_seconds = time.monotonic() - began
        mine, why = measure_mwms(args, ddl_seconds)
        errors = ddl.allgather_object(why, name="bench/mwms-errors")
        if any(errors):
            if ddl.rank() == 0:
                print("--compare mwms failed:\n" + "\n".join(
                    f"rank {r}: {e}" for r, e in enumerate(errors) if e),
                    file=sys.stderr, flush=True)
            ddl.shutdown()
            sys.exit(1)
        rates["mwms"] = mine
    totals = {label: report(label, r) for label, r in rates.items()}
    if "mwms" in totals:
        log(f"ddl / mwms: {totals['ddl'] / totals['mwms']:.2f}")
    if alone is not None:
        n = ddl.size()
        log(f"one rank alone: {alone:.1f} img/sec; scaling efficiency on {n} rank(s): "
            f"{100 * totals['ddl'] / (n * alone):.1f}%")
    ddl.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
