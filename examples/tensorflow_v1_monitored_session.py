"""The seed README's TensorFlow program, in tf.compat.v1, with ddl.

    ddlrun -np 2 python examples/tensorflow_v1_monitored_session.py [--data-dir DIR]

Step by step as the seed describes it: initialize ddl; pin the process's GPU by local
rank (``config.gpu_options.visible_device_list``; nothing to pin on a CPU-only host);
scale the learning rate (Adagrad) by the number of ranks; wrap the optimizer in
``DistributedOptimizer``; add ``BroadcastGlobalVariablesHook(0)``; and save checkpoints
only on rank 0 (``checkpoint_dir=None`` elsewhere), all under a MonitoredTrainingSession.
The model is a softmax regression on MNIST (``--data-dir``) or a synthetic MNIST-shaped
set.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402
import mnist_data  # noqa: E402

tf.compat.v1.disable_eager_execution()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir")
    p.add_argument("--steps", type=int, default=400, help="in total, divided among ranks")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--checkpoint-dir", default="/tmp/train_logs")
    args = p.parse_args(argv)

    # Initialize ddl
    hvd.init()

    # Pin GPU to be used to process local rank (one GPU per process)
    config = tf.compat.v1.ConfigProto()
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    # Build model...
    (x_train, y_train), _, source = mnist_data.load(args.data_dir)
    x_train = x_train[hvd.rank()::hvd.size()].reshape(-1, 784)
    y_train = y_train[hvd.rank()::hvd.size()]
    images = tf.compat.v1.placeholder(tf.float32, [None, 784])
    labels = tf.compat.v1.placeholder(tf.int64, [None])
    w = tf.compat.v1.get_variable(
        "w", initializer=tf.random.normal([784, 10], stddev=0.05, seed=hvd.rank()))
    b = tf.compat.v1.get_variable("b", initializer=tf.zeros([10]))
    logits = tf.matmul(images, w) + b
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    opt = tf.compat.v1.train.AdagradOptimizer(0.01 * hvd.size())

    # Add ddl Distributed Optimizer
    opt = hvd.DistributedOptimizer(opt)

    # Add hook to broadcast variables from rank 0 to all other processes during
    # initialization.
    global_step = tf.compat.v1.train.get_or_create_global_step()
    hooks = [hvd.BroadcastGlobalVariablesHook(0),
             tf.compat.v1.train.StopAtStepHook(last_step=max(1, args.steps // hvd.size())),
             tf.compat.v1.train.LoggingTensorHook({"step": global_step, "loss": loss},
                                                  every_n_iter=50)
             if hvd.rank() == 0 else tf.compat.v1.train.SessionRunHook()]

    # Make training operation
    train_op = opt.minimize(loss, global_step=global_step)

    # Save checkpoints only on worker 0 to prevent other workers from corrupting them.
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
    if hvd.rank() == 0:
        print(f"training on {source}; checkpoints in {checkpoint_dir}", flush=True)

    rng = np.random.default_rng(hvd.rank())
    # The MonitoredTrainingSession takes care of session initialization,
    # restoring from a checkpoint, saving to a checkpoint, and closing when done
    # or an error occurs.
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir,
                                                     config=config,
                                                     hooks=hooks) as mon_sess:
        while not mon_sess.should_stop():
            # Perform synchronous training.
            batch = rng.integers(0, len(x_train), args.batch_size)
            _, value = mon_sess.run([train_op, loss],
                                    {images: x_train[batch], labels: y_train[batch]})
    if hvd.rank() == 0:
        print(f"final loss {value:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
