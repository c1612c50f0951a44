"""Checks of ddl.tensorflow and ddl.keras, run inside every rank of one world
(see test_tensorflow.py). Each returns a list of failure strings."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402


def _fail(out, cond, what):
    if not cond:
        out.append(f"rank {hvd.rank()}: {what}")


def check_collectives_in_three_modes() -> list:
    """Every collective eagerly, in a tf.function and in a v1 graph, across dtypes."""
    out = []
    r, n = hvd.rank(), hvd.size()
    dtypes = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8]

    def calls(x, tag):
        s = hvd.allreduce(x, name=f"{tag}/sum", op=hvd.Sum)
        g = hvd.allgather(x, name=f"{tag}/gather")
        b = hvd.broadcast(x, root_rank=n - 1, name=f"{tag}/bcast")
        a, splits = hvd.alltoall(tf.concat([x] * n, 0), name=f"{tag}/a2a")
        rs = hvd.reducescatter(tf.concat([x] * n, 0), name=f"{tag}/rs", op=hvd.Sum)
        gr = hvd.grouped_allreduce([x, x], name=f"{tag}/grouped", op=hvd.Max)
        return [s, g, b, a, splits, rs] + gr

    def expect(results, dt, mode):
        base = np.arange(4) % 3
        np_dt = dt.as_numpy_dtype
        every = [(base + k).astype(np_dt) for k in range(n)]
        total = sum(base + k for k in range(n)).astype(np_dt)
        want = [total, np.concatenate(every), every[n - 1], np.concatenate(every),
                np.full(n, 4), total, every[n - 1], every[n - 1]]
        for i, (g, w) in enumerate(zip([np.asarray(x) for x in results], want)):
            _fail(out, g.dtype == w.dtype and np.array_equal(g, w),
                  f"{mode} {dt.name} result {i}: {g} vs {w}")

    for dt in dtypes:
        x = tf.cast(tf.constant(np.arange(4) % 3 + r), dt)
        expect(calls(x, f"eager/{dt.name}"), dt, "eager")
        traced = tf.function(lambda t, dt=dt: calls(t, f"fn/{dt.name}"))
        expect(traced(x), dt, "tf.function")
        expect(traced(x), dt, "tf.function again")
        g = tf.Graph()
        with g.as_default():
            ph = tf.compat.v1.placeholder(dt, [4])
            ops = calls(ph, f"v1/{dt.name}")
            with tf.compat.v1.Session(graph=g) as sess:
                expect(sess.run(ops, {ph: np.asarray(x)}), dt, "v1 graph")
    return out


def check_gradients() -> list:
    """Gradients of allreduce, allgather and broadcast, eagerly and in a tf.function."""
    out = []
    r, n = hvd.rank(), hvd.size()
    total = sum(k + 1 for k in range(n))

    w = tf.Variable(tf.ones([2]))             # the same shape everywhere
    v = tf.Variable(tf.ones([r + 1, 2]))      # rows differ per rank

    def grads(tag):
        with tf.GradientTape(persistent=True) as tape:
            la = tf.reduce_sum(hvd.allreduce(w * 3.0, name=f"{tag}/ar", op=hvd.Sum) * (r + 1))
            lg = tf.reduce_sum(hvd.allgather(v * 2.0, name=f"{tag}/ag") * (r + 1))
            lb = tf.reduce_sum(hvd.broadcast(w, root_rank=0, name=f"{tag}/bc") * (r + 1))
        return tape.gradient(la, w), tape.gradient(lg, v), tape.gradient(lb, w)

    for mode, fn in (("eager", grads), ("tf.function", tf.function(grads))):
        try:
            ga, gg, gb = [np.asarray(t) for t in fn(f"grad/{mode}")]
        except Exception as exc:  # noqa: BLE001
            out.append(f"rank {r}: {mode} gradients raised {exc!r}")
            continue
        _fail(out, np.allclose(ga, 3.0 * total), f"{mode} allreduce grad {ga}")
        _fail(out, np.allclose(gg, 2.0 * total) and gg.shape == (r + 1, 2),
              f"{mode} allgather grad {gg}")
        _fail(out, np.allclose(gb, total if r == 0 else 0.0), f"{mode} broadcast grad {gb}")
    return out
