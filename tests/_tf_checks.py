"""Checks of ddl.tensorflow and ddl.keras, run inside every rank of one world
(see the tcp world of test_contract.py). Each returns a list of failure strings."""

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
        a = hvd.alltoall(tf.concat([x] * n, 0), name=f"{tag}/a2a")  # no splits: the rows
        rows = tf.cast(tf.fill([n], tf.shape(x)[0]), tf.int64)
        _, splits = hvd.alltoall(tf.concat([x] * n, 0), splits=rows, name=f"{tag}/a2a_s")
        rs = hvd.reducescatter(tf.concat([x] * n, 0), name=f"{tag}/rs", op=hvd.Sum)
        gr = hvd.grouped_allreduce([x, x], name=f"{tag}/grouped", op=hvd.Max)
        gag = hvd.grouped_allgather([x, x[:1]], name=f"{tag}/g_gather")
        grs = hvd.grouped_reducescatter([tf.concat([x] * n, 0)], name=f"{tag}/g_rs",
                                        op=hvd.Max)
        rs2 = hvd.reducescatter(tf.concat([x] * n, 0), name=f"{tag}/rs_post", op=hvd.Sum,
                                postscale_factor=2)
        return [s, g, b, a, splits, rs] + gr + gag + grs + [rs2]

    def expect(results, dt, mode):
        base = np.arange(4) % 3
        np_dt = dt.as_numpy_dtype
        every = [(base + k).astype(np_dt) for k in range(n)]
        total = sum(base + k for k in range(n)).astype(np_dt)
        want = [total, np.concatenate(every), every[n - 1], np.concatenate(every),
                np.full(n, 4, np.int32), total, every[n - 1], every[n - 1], np.concatenate(every),
                np.concatenate([e[:1] for e in every]), every[n - 1],
                (2 * total).astype(np_dt)]
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
            with hvd.in_order():  # several collectives in one session.run
                ops = calls(ph, f"v1/{dt.name}")
            with tf.compat.v1.Session(graph=g) as sess:
                expect(sess.run(ops, {ph: np.asarray(x)}), dt, "v1 graph")
    # topology as ops (read when they run), eagerly and in a v1 graph

    def queries():
        return [hvd.size_op(), hvd.local_size_op(), hvd.rank_op(), hvd.local_rank_op(),
                hvd.process_set_included_op(0), hvd.size_op(process_set_id=0),
                hvd.process_set_included_op(process_set_id=0)]
    got = [int(q) for q in queries()]
    _fail(out, got[0] == n and got[2] == r and got[4] == 1
          and got[1] == hvd.local_size() and got[3] == hvd.local_rank()
          and got[5:] == [n, 1], f"query ops: {got}")
    g = tf.Graph()
    with g.as_default():
        ops = queries()
        with tf.compat.v1.Session(graph=g) as sess:
            _fail(out, [int(v) for v in sess.run(ops)] == got, "query ops in a v1 graph")
    # a broadcast's gradient in a v1 graph: its allreduce runs on every rank, though the
    # non-roots' gradient (zeros) needs only its shape
    g = tf.Graph()
    with g.as_default():
        ph = tf.compat.v1.placeholder(tf.float32, [3])
        grad = tf.gradients(hvd.broadcast(ph * 2.0, 0, name="v1/bgrad"), ph)[0]
        with tf.compat.v1.Session(graph=g) as sess:
            got = sess.run(grad, {ph: np.ones(3, np.float32)})
    _fail(out, np.array_equal(got, np.full(3, 2.0 if r == 0 else 0.0)),
          f"a broadcast's gradient in a v1 graph: {got}")
    # Horovod's ids of a set added on every rank: the same id everywhere, taken by the ops
    single = hvd.add_process_set([0])
    ids = hvd.allgather(tf.constant([single.process_set_id]), name="ps/ids").numpy()
    got = [int(hvd.size_op(process_set_id=single.process_set_id)),
           int(hvd.process_set_included_op(process_set_id=single.process_set_id))]
    _fail(out, single.process_set_id not in (None, 0) and set(ids) == {single.process_set_id}
          and got == [1, int(r == 0)], f"a set added on every rank: ids {ids}, ops {got}")
    old_id = single.process_set_id
    hvd.remove_process_set(single)
    try:
        hvd.size_op(old_id)
        out.append(f"rank {r}: size_op({old_id}) of a removed set did not raise")
    except ValueError as exc:
        _fail(out, single.process_set_id is None
              and f"this rank knows no process set {old_id}" in str(exc),
              f"size_op({old_id}) after removal: {exc}")
    # Horovod's keywords and compression on every reducing op; Keras's positional name
    import ddl.keras as hk
    x = tf.constant([1.0, 2.0] * n) * (r + 1)
    fp16 = hvd.Compression.fp16
    got = [hvd.allreduce(x, device_dense="", device_sparse="", compression=fp16, op=hvd.Sum,
                         name="kw/ar", ignore_name_scope=True),
           hvd.reducescatter(x, "", fp16, hvd.Sum, "kw/rs", prescale_factor=2),
           *hvd.grouped_allreduce([x], compression=fp16, op=hvd.Max, name="kw/gar"),
           *hvd.grouped_reducescatter([x], compression=fp16, name="kw/grs"),
           hk.allreduce(x, "kw/keras", op=hvd.Sum), hk.reducescatter(x, "kw/keras_rs")]
    tri = n * (n + 1) / 2
    want = [np.array([tri, 2 * tri] * n), 2 * np.array([tri, 2 * tri]),
            np.array([n, 2 * n] * n), np.array([tri / n, 2 * tri / n]),
            np.array([tri, 2 * tri] * n), np.array([tri / n, 2 * tri / n])]
    _fail(out, all(g.dtype == tf.float32 and np.allclose(g.numpy(), w)
                   for g, w in zip(got, want)), f"Horovod keywords: {got}")
    # a tf.IndexedSlices, as Horovod: gathered rows, Average divides the values
    sl = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([n, 2]))
    got = hvd.allreduce(sl, name="kw/slices")
    _fail(out, isinstance(got, tf.IndexedSlices) and np.allclose(
        tf.convert_to_tensor(got).numpy(), [[(k + 1) / n] * 2 for k in range(n)]),
          f"IndexedSlices allreduce: {got}")
    try:   # dense shapes that differ: the same MismatchError on every rank
        hvd.allreduce(tf.IndexedSlices(sl.values, sl.indices, tf.constant([n + r, 2])),
                      name="kw/slices_shapes")
        out.append(f"rank {r}: slices of different dense shapes did not raise")
    except hvd.MismatchError as exc:
        _fail(out, "IndexedSlices dense_shape mismatch: rank 0 sent [2, 2], rank 1 sent "
                   "[3, 2]" in str(exc), f"IndexedSlices shape mismatch: {exc}")
    try:
        hvd.allreduce(sl, name="kw/slices_max", op=hvd.Max)
        out.append(f"rank {r}: an IndexedSlices Max did not raise")
    except ValueError as exc:
        _fail(out, "op must be Sum or Average" in str(exc), f"IndexedSlices Max: {exc}")
    # Horovod's TensorFlow signatures of the object collectives and broadcast_variables
    got = (hvd.broadcast_object({"r": r}, n - 1, None, "obj_tf"),
           hvd.allgather_object(r, session=None, name="objs_tf"))
    _fail(out, got == ({"r": n - 1}, list(range(n))), f"object collectives: {got}")
    v = tf.Variable([float(r)] * 3)
    hvd.broadcast_variables([v], n - 1, hvd.global_process_set, inplace=True)
    _fail(out, np.array_equal(v.numpy(), [float(n - 1)] * 3), f"broadcast_variables: {v}")
    # something TensorFlow cannot convert on one rank alone: every rank's call fails at
    # once (the others with InvalidRequestError naming it), not after the stall timeout
    for call in (lambda x: hvd.allreduce(x, name="one/none"),
                 lambda x: hvd.grouped_allreduce([x], name="one/group")):
        try:
            call(None if r == 1 else tf.ones(2))
            out.append(f"rank {r}: None on rank 1 did not raise")
        except (ValueError, hvd.InvalidRequestError) as exc:
            _fail(out, isinstance(exc, ValueError if r == 1 else hvd.InvalidRequestError)
                  and (r == 1 or "rank 1 passed NoneType to ddl.tensorflow." in str(exc)),
                  f"None on rank 1: {type(exc).__name__}: {exc}")
    # one model under other Keras names on each rank (built after other models, or loaded
    # from a file on one rank only): the variables still pair up, by position
    import keras
    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name=f"d{r}")],
                           name=f"net{r}")
    for w in net.variables:
        w.assign(tf.fill(w.shape, float(r + 1)))
    hvd.broadcast_variables(net.variables, 0)
    _fail(out, all(np.all(w.numpy() == 1.0) for w in net.variables),
          f"broadcast_variables across Keras names {[w.path for w in net.variables]}")
    bcast = hvd.broadcast_object_fn(root_rank=n - 1, name="obj_fn")
    _fail(out, bcast({"rank": r}) == {"rank": n - 1}, "broadcast_object_fn")
    return out


def check_gradients() -> list:
    """Gradients of allreduce, allgather, broadcast, alltoall, the grouped ops and
    reducescatter, eagerly and in a tf.function, with Horovod's TensorFlow conventions."""
    out = []
    r, n = hvd.rank(), hvd.size()
    total = sum(k + 1 for k in range(n))

    w = tf.Variable(tf.ones([2]))             # the same shape everywhere
    v = tf.Variable(tf.ones([r + 1, 2]))      # rows differ per rank

    a = tf.Variable(tf.fill([n, 2], float(r + 1)))   # one row to each rank

    s = tf.Variable(tf.ones([2 * n, 2]))      # block k (2 rows) is rank k's after a scatter

    def grads(tag):
        with tf.GradientTape(persistent=True) as tape:
            la = tf.reduce_sum(hvd.allreduce(w * 3.0, name=f"{tag}/ar", op=hvd.Sum) * (r + 1))
            lg = tf.reduce_sum(hvd.allgather(v * 2.0, name=f"{tag}/ag") * (r + 1))
            lb = tf.reduce_sum(hvd.broadcast(w, root_rank=0, name=f"{tag}/bc") * (r + 1))
            # row j of rank r goes to rank j, whose loss weighs it j + 2
            lt = tf.reduce_sum(hvd.alltoall(a, name=f"{tag}/a2a") * (r + 2))
            # the grouped ops and reducescatter (Horovod's TensorFlow gradients)
            lga = tf.add_n([tf.reduce_sum(t) for t in hvd.grouped_allreduce(
                [w * 3.0, w * 2.0], op=hvd.Sum, name=f"{tag}/gar")]) * (r + 1)
            lgg = tf.add_n([tf.reduce_sum(t) for t in hvd.grouped_allgather(
                [v * 2.0, w], name=f"{tag}/gag")]) * (r + 1)
            lrs = tf.reduce_sum(hvd.reducescatter(s * 2.0, op=hvd.Sum, name=f"{tag}/rs")) \
                * (r + 1)
            lgrs = tf.reduce_sum(hvd.grouped_reducescatter([s * 2.0], name=f"{tag}/grs")[0]) \
                * (r + 1)
        return (tape.gradient(la, w), tape.gradient(lg, v), tape.gradient(lb, w),
                tape.gradient(lt, a), tape.gradient(lga, w), tape.gradient(lgg, [v, w]),
                tape.gradient(lrs, s), tape.gradient(lgrs, s))

    blocks = np.repeat(np.arange(1.0, n + 1), 2)[:, None] * np.ones((1, 2))  # owner k: k + 1
    for mode, fn in (("eager", grads), ("tf.function", tf.function(grads))):
        try:
            ga, gg, gb, gt, gga, (ggv, ggw), grs, ggrs = [
                [np.asarray(x) for x in t] if isinstance(t, (list, tuple)) else np.asarray(t)
                for t in fn(f"grad/{mode}")]
        except Exception as exc:  # noqa: BLE001
            out.append(f"rank {r}: {mode} gradients raised {exc!r}")
            continue
        _fail(out, np.allclose(gga, 5.0 * total), f"{mode} grouped_allreduce grad {gga}")
        _fail(out, np.allclose(ggv, 2.0 * total / n) and np.allclose(ggw, total / n),
              f"{mode} grouped_allgather grads {ggv} {ggw}")
        _fail(out, np.allclose(grs, 2.0 * n * blocks), f"{mode} reducescatter grad {grs}")
        _fail(out, np.allclose(ggrs, 2.0 * blocks), f"{mode} grouped_reducescatter {ggrs}")
        _fail(out, np.allclose(ga, 3.0 * total), f"{mode} allreduce grad {ga}")
        # allgather and broadcast average the incoming gradients, as Horovod's TensorFlow
        # ops do (its torch ones sum): each rank's loss weighs them r + 1
        _fail(out, np.allclose(gg, 2.0 * total / n) and gg.shape == (r + 1, 2),
              f"{mode} allgather grad {gg}")
        _fail(out, np.allclose(gb, total / n if r == 0 else 0.0),
              f"{mode} broadcast grad {gb}")
        _fail(out, np.array_equal(gt, [[j + 2.0] * 2 for j in range(n)]),
              f"{mode} alltoall grad {gt}")
    return out


def _data(rows: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, 5)).astype(np.float32),
            rng.standard_normal((rows, 1)).astype(np.float32))


def _model(seed: int = 0):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def check_tape_contract() -> list:
    """DistributedGradientTape in a tf.function: 2 ranks at batch b give the weights of
    1 rank at batch 2b after 3 steps (SGD with momentum), to 1e-5."""
    import keras
    out = []
    r, n = hvd.rank(), hvd.size()
    b, steps = 4, 3
    x, y = _data(steps * n * b)
    ref, dist = _model(), _model()
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def dist_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, dist(xb))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, dist.trainable_variables)
        opt.apply_gradients(zip(grads, dist.trainable_variables))

    @tf.function
    def ref_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, ref(xb))
        grads = tape.gradient(loss, ref.trainable_variables)
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))

    for k in range(steps):
        rows = slice(k * n * b, (k + 1) * n * b)
        ref_step(x[rows], y[rows])
        mine = slice(k * n * b + r * b, k * n * b + (r + 1) * b)
        dist_step(x[mine], y[mine])
    for a, c in zip(dist.trainable_variables, ref.trainable_variables):
        err = float(np.max(np.abs(a.numpy() - c.numpy())))
        _fail(out, err <= 1e-5, f"tape contract: {a.path} differs by {err:.3g}")
    return out


def check_keras_fit() -> list:
    """model.fit with ddl.keras.DistributedOptimizer and the callbacks: the numerical
    contract, identical variables after the broadcast callback, averaged metrics, the
    warm-up schedule, and load_model re-wrapping the optimizer."""
    import keras
    import ddl.keras as dk
    out = []
    r, n = hvd.rank(), hvd.size()
    b, steps = 4, 3
    x, y = _data(steps * n * b, seed=5)
    mine = np.concatenate([np.arange(k * n * b + r * b, k * n * b + (r + 1) * b)
                           for k in range(steps)])
    ref = _model(1)
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    ref.fit(x, y, batch_size=n * b, epochs=1, shuffle=False, verbose=0)
    dist = _model(100 + r)  # different initial weights on every rank...
    dist.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
                 loss="mse")
    # ...which the broadcast callback replaces by rank 0's (the reference's, seed 1)
    if r == 0:
        dist.set_weights(_model(1).get_weights())
    history = dist.fit(x[mine], y[mine], batch_size=b, epochs=1, shuffle=False, verbose=0,
                       callbacks=[dk.callbacks.BroadcastGlobalVariablesCallback(0),
                                  dk.callbacks.MetricAverageCallback(device="")])
    for a, c in zip(dist.trainable_variables, ref.trainable_variables):
        err = float(np.max(np.abs(a.numpy() - c.numpy())))
        _fail(out, err <= 1e-5, f"fit contract: {a.path} differs by {err:.3g}")
    # the optimizer's options reach fit: Sum with lr / n is Average; fp16 compression,
    # groups and a predivide factor give the same step to fp16's precision
    for kw, lr, tol in ((dict(op=hvd.Sum, num_groups=2), 0.05 / n, 1e-5),
                        (dict(compression=dk.Compression.fp16, gradient_predivide_factor=2.0,
                              groups=1), 0.05, 2e-3)):
        ref_o, dist_o = _model(7), _model(7)
        ref_o.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        ref_o.fit(x, y, batch_size=n * b, epochs=1, shuffle=False, verbose=0)
        dist_o.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(lr), **kw),
                       loss="mse")
        dist_o.fit(x[mine], y[mine], batch_size=b, epochs=1, shuffle=False, verbose=0)
        for a, c in zip(dist_o.trainable_variables, ref_o.trainable_variables):
            err = float(np.max(np.abs(a.numpy() - c.numpy())))
            _fail(out, err <= tol, f"fit with {kw}: {a.path} differs by {err:.3g}")
    digests = hvd.allgather_object([v.numpy().tobytes() for v in dist.variables])
    _fail(out, all(d == digests[0] for d in digests), "variables differ across ranks")
    losses = hvd.allgather_object(history.history["loss"])
    _fail(out, all(np.allclose(l, losses[0]) for l in losses),
          f"MetricAverageCallback: {losses}")
    # the warm-up schedule: lr = initial / size * (1 + e * (size - 1) / warmup)
    warm = dk.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    dist.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(0.4)), loss="mse")
    dist.fit(x[mine], y[mine], batch_size=b, epochs=3, shuffle=False, verbose=0,
             callbacks=[warm])
    want = [(e + (k + 1) / steps, 0.4 / n * (1 + (e + (k + 1) / steps) * (n - 1) / 2))
            for e in range(2) for k in range(steps)]
    got = [(round(e, 6), lr) for e, lr in warm.history]
    _fail(out, len(got) == len(want) and all(abs(g[0] - w[0]) < 1e-6 and
                                             abs(g[1] - w[1]) < 1e-9
                                             for g, w in zip(got, want)),
          f"warm-up schedule {got} vs {want}")
    _fail(out, abs(float(np.asarray(dist.optimizer.learning_rate)) - 0.4) < 1e-6,
          "after the warm-up the rate is the initial one")
    sched = dk.callbacks.LearningRateScheduleCallback(initial_lr=0.4,
                                                      multiplier=lambda epoch: 0.5,
                                                      start_epoch=1)
    dist.fit(x[mine], y[mine], batch_size=b, epochs=2, shuffle=False, verbose=0,
             callbacks=[sched])
    _fail(out, [lr for _, lr in sched.history] == [0.2], f"schedule {sched.history}")
    # load_model wraps the saved optimizer again
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"m{r}.keras")
        dist.save(path)
        loaded = dk.load_model(path, custom_optimizers=[type(dist.optimizer)],
                               compression=dk.Compression.fp16)
        _fail(out, getattr(loaded.optimizer, "_ddl_wrapped", False),
              "load_model did not wrap the optimizer")
        loaded.fit(x[mine], y[mine], batch_size=b, epochs=1, shuffle=False, verbose=0)
    return out


def check_v1_monitored_session() -> list:
    """tf.compat.v1: DistributedOptimizer + BroadcastGlobalVariablesHook under a
    MonitoredTrainingSession: same variables after the hook, and the numerical contract
    of 3 steps against one rank's full batch."""
    out = []
    r, n = hvd.rank(), hvd.size()
    b, steps = 4, 3
    x, y = _data(steps * n * b, seed=9)
    init = np.random.default_rng(42).standard_normal((5, 1)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=init + r)  # differs per rank
        xb = tf.compat.v1.placeholder(tf.float32, [None, 5])
        yb = tf.compat.v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(xb, w) - yb))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.minimize(loss, global_step=global_step)
        hooks = [hvd.BroadcastGlobalVariablesHook(0),
                 tf.compat.v1.train.StopAtStepHook(last_step=steps + 1)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            after_hook = sess.run(w)
            for k in range(steps):
                rows = slice(k * n * b + r * b, k * n * b + (r + 1) * b)
                sess.run(train, {xb: x[rows], yb: y[rows]})
            final = sess.run(w)
    _fail(out, np.array_equal(after_hook, init), "BroadcastGlobalVariablesHook")
    ref = init.copy()
    for k in range(steps):
        xs, ys = x[k * n * b:(k + 1) * n * b], y[k * n * b:(k + 1) * n * b]
        ref -= 0.1 * (2.0 / len(xs)) * xs.T @ (xs @ ref - ys)
    _fail(out, np.allclose(final, ref, atol=1e-5), f"v1 contract: {final.T} vs {ref.T}")
    return out


def check_sparse_gradients() -> list:
    """tf.IndexedSlices gradients: allgathered (values and indices), or densified."""
    import keras
    out = []
    r, n = hvd.rank(), hvd.size()
    emb = keras.layers.Embedding(10, 3)
    emb.build((None,))
    want = np.zeros((10, 3), np.float32)
    for k in range(n):
        want[k] += 1.0 / n
        want[k + 1] += 1.0 / n
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(tf.constant([r, r + 1])))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        (grad,) = tape.gradient(loss, emb.trainable_variables)
        kind = isinstance(grad, tf.IndexedSlices)
        _fail(out, kind != sparse_as_dense, f"sparse_as_dense={sparse_as_dense}: {type(grad)}")
        _fail(out, np.allclose(tf.convert_to_tensor(grad).numpy(), want),
              f"sparse_as_dense={sparse_as_dense}: {tf.convert_to_tensor(grad).numpy()}")
    return out


def check_sparse_allreduce_like_horovod() -> list:
    """allreduce of a tf.IndexedSlices as Horovod's: slices built without a dense_shape
    are gathered (and come back without one); pre/postscale factors and ops other than
    Sum/Average raise NotImplementedError (also a ValueError) on every rank, before any
    collective, instead of being dropped."""
    out = []
    r, n = hvd.rank(), hvd.size()
    rows = tf.fill([2, 3], float(r + 1))
    slices = tf.IndexedSlices(rows, tf.constant([r, r + 1]))      # no dense_shape
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        try:
            got = hvd.allreduce(slices, op=op, name=f"sparse_no_shape/{op.name}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"rank {r}: {op.name} of slices without dense_shape raised {exc!r}")
            continue
        want = np.concatenate([np.full((2, 3), (k + 1) * scale) for k in range(n)])
        _fail(out, np.allclose(got.values.numpy(), want), f"{op.name} values {got.values}")
        _fail(out, got.indices.numpy().tolist() == [j for k in range(n) for j in (k, k + 1)],
              f"{op.name} indices {got.indices}")
        _fail(out, got.dense_shape is None, f"{op.name} dense_shape {got.dense_shape}")
    shaped = tf.IndexedSlices(rows, tf.constant([r, r + 1]), dense_shape=[n + 1, 3])
    for kw in (dict(prescale_factor=0.5), dict(postscale_factor=2.0), dict(op=hvd.Min),
               dict(op=hvd.Adasum)):
        try:
            hvd.allreduce(shaped, name="sparse_refused", **kw)
            out.append(f"rank {r}: allreduce(IndexedSlices, {kw}) did not raise")
        except NotImplementedError as exc:
            _fail(out, isinstance(exc, ValueError) and "IndexedSlices" in str(exc),
                  f"allreduce(IndexedSlices, {kw}) raised {exc!r}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"rank {r}: allreduce(IndexedSlices, {kw}) raised {exc!r}, "
                       f"not NotImplementedError")
    # grouped: slices come back as slices (gathered), the dense tensors reduced as a group
    dense = tf.fill([3], float(r))
    try:
        got = hvd.grouped_allreduce([slices, dense, shaped], op=hvd.Sum, name="g_sparse")
    except Exception as exc:  # noqa: BLE001
        return out + [f"rank {r}: grouped_allreduce with IndexedSlices raised {exc!r}"]
    want = np.concatenate([np.full((2, 3), float(k + 1)) for k in range(n)])
    _fail(out, isinstance(got[0], tf.IndexedSlices) and isinstance(got[2], tf.IndexedSlices)
          and np.allclose(got[0].values.numpy(), want)
          and np.allclose(got[2].values.numpy(), want)
          and np.asarray(got[2].dense_shape).tolist() == [n + 1, 3],
          f"grouped_allreduce slices: {got[0]}, {got[2]}")
    _fail(out, np.allclose(got[1].numpy(), sum(range(n))), f"grouped dense part {got[1]}")
    for kw in (dict(prescale_factor=0.5), dict(op=hvd.Adasum)):   # before the dense part
        try:
            hvd.grouped_allreduce([shaped, tf.cast(dense, tf.int32)], name="g_sparse_refused",
                                  **kw)
            out.append(f"rank {r}: grouped_allreduce(IndexedSlices, {kw}) did not raise")
        except NotImplementedError:
            pass
        except Exception as exc:  # noqa: BLE001
            out.append(f"rank {r}: grouped_allreduce(IndexedSlices, {kw}) raised {exc!r}")
    return out


def check_alltoall_split_dtypes() -> list:
    """alltoall(t, splits) takes splits of any integer dtype, as Horovod's (whose op
    takes int32): an int32 or int64 tensor, a NumPy array, a list; eagerly and in a
    tf.function."""
    out = []
    r, n = hvd.rank(), hvd.size()
    x = tf.fill([n * (r + 1), 2], float(r))
    want = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
    forms = {"int32": tf.constant([r + 1] * n, tf.int32),
             "int64": tf.constant([r + 1] * n, tf.int64),
             "numpy": np.array([r + 1] * n, np.int32), "list": [r + 1] * n}
    for form, splits in forms.items():
        for mode in ("eager", "tf.function"):
            def call(t, splits=splits, form=form, mode=mode):
                return hvd.alltoall(t, splits, name=f"a2a_splits/{form}/{mode}")
            fn = call if mode == "eager" else tf.function(call)
            try:
                got, rsplits = fn(x)
            except Exception as exc:  # noqa: BLE001
                out.append(f"rank {r}: {mode} alltoall with {form} splits raised {exc!r}")
                continue
            _fail(out, np.array_equal(got.numpy(), want), f"{mode} {form}: {got.numpy()}")
            _fail(out, rsplits.numpy().tolist() == [k + 1 for k in range(n)]
                  and rsplits.dtype == tf.int32,
                  f"{mode} {form}: received splits {rsplits!r} (int32, as Horovod's)")
    return out


def check_inplace_broadcast() -> list:
    """broadcast_(variables, root_rank), Horovod's in-place broadcast: every rank's
    variables take the root's values (bool and float16 too) and come back, eagerly and
    in a tf.function."""
    out = []
    r, n = hvd.rank(), hvd.size()
    for dtype in (tf.float32, tf.float16, tf.int64, tf.bool):
        vs = [tf.Variable(tf.cast(tf.fill([2] * d, (r + 1) % 2 if dtype == tf.bool else r),
                                  dtype)) for d in (1, 2)]
        root = n - 1
        back = hvd.broadcast_(vs, root, name=f"bcast_/{dtype.name}")
        _fail(out, len(back) == 2 and all(b is v for b, v in zip(back, vs)),
              f"{dtype.name}: broadcast_ returned {back}")
        want = (root + 1) % 2 if dtype == tf.bool else root
        for v in vs:
            _fail(out, v.dtype == dtype and np.all(v.numpy() == want),
                  f"{dtype.name}: {v.numpy()} after broadcast_ from {root}")
    w = tf.Variable(tf.fill([3], float(r)))

    @tf.function
    def step():
        (got,) = hvd.broadcast_([w], 0, name="bcast_/fn")
        return got
    _fail(out, np.all(step().numpy() == 0.0) and np.all(w.numpy() == 0.0),
          f"tf.function broadcast_: {w.numpy()}")
    # eagerly there are no global variables: an error, as Horovod's, not a silent no-op
    try:
        hvd.broadcast_global_variables(0)
        out.append(f"rank {r}: eager broadcast_global_variables did not raise")
    except RuntimeError as exc:
        _fail(out, "broadcast_variables" in str(exc), f"eager error says {exc}")
    return out


def check_tape_options() -> list:
    """DistributedGradientTape with num_groups, explicit groups, fp16 compression, a
    predivide factor and Sum; and the gradient of an Average allreduce."""
    out = []
    r, n = hvd.rank(), hvd.size()
    vs = [tf.Variable(tf.fill([3], float(k + 1))) for k in range(4)]
    want_avg = [np.full(3, (k + 1) * sum(j + 1 for j in range(n)) / n) for k in range(4)]
    settings = [dict(num_groups=2), dict(groups=[[vs[0], vs[3]], [vs[1]]]),
                dict(compression=hvd.Compression.fp16), dict(gradient_predivide_factor=2.0),
                dict(op=hvd.Sum)]
    for kw in settings:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) / 2.0 * (r + 1) for v in vs])
        grads = hvd.DistributedGradientTape(tape, **kw).gradient(loss, vs)
        scale = n if kw.get("op") == hvd.Sum else 1
        for k, (g, w) in enumerate(zip(grads, want_avg)):
            _fail(out, np.allclose(g.numpy(), w * scale, rtol=1e-3),
                  f"tape {kw}: grad {k} {g.numpy()} vs {w * scale}")
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allreduce(x * (r + 1), name="grad/average") * (r + 2))
    g = tape.gradient(y, x).numpy()
    want = (r + 1) * sum(k + 2 for k in range(n)) / n
    _fail(out, np.allclose(g, want), f"Average allreduce gradient {g} vs {want}")
    return out


def check_adasum_gradients() -> list:
    """op=Adasum in DistributedGradientTape (one fused group, and a sparse gradient,
    which Adasum densifies) and in ddl.keras.DistributedOptimizer: each gradient is the
    Adasum of every rank's gradient of that variable (tests/_checks.reference_adasum)."""
    import keras
    import ddl.keras as dk
    from _checks import reference_adasum
    out = []
    r, n = hvd.rank(), hvd.size()
    shapes = [(3,), (2, 2), (5,)]

    def coeffs(rank):
        rng = np.random.default_rng(40 + rank)
        return [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
    want = [reference_adasum([coeffs(j)[k] for j in range(n)]) for k in range(len(shapes))]
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    for kw in (dict(num_groups=1), {}):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(vs, coeffs(r))])
        grads = hvd.DistributedGradientTape(tape, op=hvd.Adasum, **kw).gradient(loss, vs)
        for k, (g, w) in enumerate(zip(grads, want)):
            _fail(out, np.allclose(g.numpy(), w, rtol=1e-5, atol=1e-6),
                  f"tape adasum {kw}: grad {k} {g.numpy()} vs {w}")
    table = tf.Variable(tf.zeros((4, 3)))
    rows = coeffs(r)[0]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [1]) * rows)  # one row: not orthogonal
    g = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [table])[0]
    dense = [np.zeros((4, 3), np.float32) for _ in range(n)]
    for j in range(n):
        dense[j][1] = coeffs(j)[0]
    _fail(out, np.allclose(tf.convert_to_tensor(g).numpy(), reference_adasum(dense),
                           atol=1e-6), f"sparse adasum gradient {g}")
    opt = dk.DistributedOptimizer(keras.optimizers.SGD(1.0), op=dk.Adasum)
    kvs = [keras.Variable(np.zeros(s, np.float32)) for s in shapes]
    opt.apply_gradients([(tf.constant(c), v) for c, v in zip(coeffs(r), kvs)])
    for k, (v, w) in enumerate(zip(kvs, want)):
        _fail(out, np.allclose(np.asarray(v), -w, rtol=1e-5, atol=1e-6),
              f"keras adasum: variable {k} {np.asarray(v)} vs {-w}")
    return out


def _allreduces(path: str, prefix: str) -> int:
    """How many ALLREDUCE phases the timeline at ``path`` shows for tensors ``prefix*``."""
    import json
    with open(path) as f:
        events = json.load(f)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"}
    return sum(1 for e in events if (e["ph"], e["name"]) == ("B", "ALLREDUCE")
               and rows.get((e["pid"], e["tid"]), "").startswith(prefix))


def check_backward_passes() -> list:
    """backward_passes_per_step=2: ddl.keras.DistributedOptimizer under model.fit leaves
    the weights alone after the first pass, gives after 4 passes on 2 ranks the weights
    of 2 steps of one process at the 4 times larger batch (summed or averaged), and
    allreduces once per 2 passes (counted in the timeline); the v1 DistributedOptimizer
    (Momentum) matches a NumPy reference and counts every pass in global_step."""
    import tempfile
    import keras
    import ddl
    import ddl.keras as dk
    out = []
    r, n = hvd.rank(), hvd.size()
    b, passes, steps = 4, 2, 2
    x, y = _data(steps * passes * n * b, seed=11)
    mine = np.concatenate([np.arange(j * n * b + r * b, j * n * b + (r + 1) * b)
                           for j in range(steps * passes)])
    for average in (False, True):
        ref = _model(3)
        ref.compile(optimizer=keras.optimizers.SGD(0.05 * (1 if average else passes),
                                                   momentum=0.5), loss="mse")
        ref.fit(x, y, batch_size=passes * n * b, epochs=1, shuffle=False, verbose=0)
        dist = _model(3)
        opt = dk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5),
                                      backward_passes_per_step=passes,
                                      average_aggregated_gradients=average)
        dist.compile(optimizer=opt, loss="mse")
        initial = dist.get_weights()
        with tempfile.TemporaryDirectory() as d:
            ddl.start_timeline(os.path.join(d, "timeline{rank}.json"))
            dist.fit(x[mine[:b]], y[mine[:b]], batch_size=b, epochs=1, shuffle=False,
                     verbose=0)
            after_one = dist.get_weights()
            dist.fit(x[mine[b:]], y[mine[b:]], batch_size=b, epochs=1, shuffle=False,
                     verbose=0)
            ddl.stop_timeline()
            count = _allreduces(os.path.join(d, f"timeline{r}.json"),
                                "keras.DistributedOptimizer/")
        tag = f"backward_passes_per_step average={average}"
        _fail(out, all(np.array_equal(a, c) for a, c in zip(after_one, initial)),
              f"{tag}: the first pass changed the weights")
        for a, c in zip(dist.trainable_variables, ref.trainable_variables):
            err = float(np.max(np.abs(a.numpy() - c.numpy())))
            _fail(out, err <= 1e-5, f"{tag}: {a.path} differs by {err:.3g}")
        want = steps * len(dist.trainable_variables)  # one allreduce per variable per step
        _fail(out, count == want, f"{tag}: {count} allreduces, want {want}")
        _fail(out, int(opt.iterations.numpy()) == steps * passes,
              f"{tag}: iterations {int(opt.iterations.numpy())}")
    # tf.compat.v1 (graph): Momentum, the sum of 2 passes applied every second run
    init = np.random.default_rng(4).standard_normal((5, 1)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=init)
        xb = tf.compat.v1.placeholder(tf.float32, [None, 5])
        yb = tf.compat.v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(xb, w) - yb))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
                                       backward_passes_per_step=passes)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.minimize(loss, global_step=global_step)
        seen = []
        with tf.compat.v1.train.MonitoredTrainingSession() as sess:
            for j in range(steps * passes):
                rows = mine[j * b:(j + 1) * b]
                sess.run(train, {xb: x[rows], yb: y[rows]})
                seen.append(sess.run(w))
            final_step = sess.run(global_step)
    ref, velocity = init.copy(), np.zeros_like(init)
    for k in range(steps):
        total = 0.0
        for p in range(passes):
            j = k * passes + p
            xs, ys = x[j * n * b:(j + 1) * n * b], y[j * n * b:(j + 1) * n * b]
            total = total + (2.0 / len(xs)) * xs.T @ (xs @ ref - ys)
        velocity = 0.9 * velocity + total
        ref = ref - 0.1 * velocity
    _fail(out, np.array_equal(seen[0], init), "v1 backward_passes_per_step: first pass applied")
    _fail(out, np.allclose(seen[-1], ref, atol=1e-5),
          f"v1 backward_passes_per_step: {seen[-1].T} vs {ref.T}")
    _fail(out, final_step == steps * passes, f"v1 global_step {final_step}")
    # bad values are refused, naming the argument
    for bad in (0, -2, 1.5, True):
        for make in (lambda: dk.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     backward_passes_per_step=bad),
                     lambda: hvd.DistributedOptimizer(
                         tf.compat.v1.train.GradientDescentOptimizer(0.1),
                         backward_passes_per_step=bad)):
            try:
                make()
                out.append(f"rank {r}: backward_passes_per_step={bad!r} was accepted")
            except ValueError as exc:
                _fail(out, "backward_passes_per_step" in str(exc), f"error: {exc}")
    # another set of variables in the middle of an accumulation is an error (first pass
    # only accumulates: no collective runs here)
    a, c = keras.Variable(np.ones(2, np.float32)), keras.Variable(np.ones(3, np.float32))
    opt = dk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    opt.apply_gradients([(tf.ones(2), a), (tf.ones(3), c)])
    try:
        opt.apply_gradients([(tf.ones(2), a)])
        out.append(f"rank {r}: a different gradient list was accepted mid-accumulation")
    except ValueError as exc:
        _fail(out, "aggregated 2 gradients before and now got 1" in str(exc), f"{exc}")
    return out


def check_partial_distributed() -> list:
    """PartialDistributedGradientTape and ddl.keras.PartialDistributedOptimizer: the
    gradients of the local layers stay local (divided by the size, as Horovod), so those
    layers diverge across ranks while the others stay equal."""
    import keras
    import ddl.keras as dk
    out = []
    r, n = hvd.rank(), hvd.size()
    x, y = _data(8, seed=20 + r)  # different data on every rank
    model = _model(5)
    first, last = model.layers
    with tf.GradientTape(persistent=True) as plain:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    local = plain.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[first])
    grads = tape.gradient(loss, model.trainable_variables)
    for v, g, mine in zip(model.trainable_variables, grads, local):
        if any(v is w for w in first.trainable_weights):
            _fail(out, np.allclose(g.numpy(), mine.numpy() / n, atol=1e-7),
                  f"partial tape: local {v.path} is not this rank's gradient / size")
        else:
            every = hvd.allgather_object(mine.numpy())
            _fail(out, np.allclose(g.numpy(), np.mean(every, axis=0), atol=1e-6),
                  f"partial tape: {v.path} is not the average")
    try:
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[object()])
        out.append(f"rank {r}: a non-layer in local_layers was accepted")
    except ValueError as exc:
        _fail(out, "keras.layers.Layer" in str(exc), f"local_layers error: {exc}")
    model = _model(6)
    model.compile(optimizer=dk.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=model.layers[0]), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    digests = hvd.allgather_object([v.numpy().tobytes() for v in model.trainable_variables])
    layer_of = [0, 0, 1, 1]  # kernel and bias of each Dense
    for k, layer in enumerate(layer_of):
        same = all(d[k] == digests[0][k] for d in digests)
        _fail(out, same == (layer == 1),
              f"PartialDistributedOptimizer: variable {k} of layer {layer} "
              f"{'equal' if same else 'differs'} across ranks")
    return out


def check_sync_batch_norm() -> list:
    """SyncBatchNormalization on uneven per-rank batches (3 and 5 rows) equals one
    process's BatchNormalization on the concatenated batch: outputs, gradients of the
    input, gamma and beta, and the moving statistics after a training step; inference
    uses the moving statistics."""
    import keras
    out = []
    r, n = hvd.rank(), hvd.size()
    rows = [3 + 2 * k for k in range(n)]
    rng = np.random.default_rng(8)
    full = (rng.standard_normal((sum(rows), 4)) * 2 + 1).astype(np.float32)
    scale = rng.standard_normal((sum(rows), 4)).astype(np.float32)
    start = sum(rows[:r])
    mine = slice(start, start + rows[r])
    ref = keras.layers.BatchNormalization(momentum=0.5)
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    for layer in (ref, sync):
        layer.build((None, 4))
        layer.gamma.assign(np.linspace(0.5, 2.0, 4))
        layer.beta.assign(np.linspace(-1.0, 1.0, 4))

    def step(layer, x, s):
        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * s)
        return [y] + tape.gradient(loss, [x, layer.gamma, layer.beta])

    try:
        hvd.SyncBatchNormalization(fused=True)
        out.append(f"rank {r}: SyncBatchNormalization(fused=True) was accepted")
    except ValueError as exc:
        _fail(out, "fused=True" in str(exc), f"fused error: {exc}")
    want = [t.numpy() for t in step(ref, full, scale)]
    for mode, fn in (("eager", step), ("tf.function", tf.function(step))):
        got = [t.numpy() for t in fn(sync, full[mine], scale[mine])]
        gamma = hvd.allreduce(got[2], op=hvd.Sum, name=f"sbn/{mode}/gamma").numpy()
        beta = hvd.allreduce(got[3], op=hvd.Sum, name=f"sbn/{mode}/beta").numpy()
        for what, g, w in (("output", got[0], want[0][mine]),
                           ("input gradient", got[1], want[1][mine]),
                           ("gamma gradient", gamma, want[2]),
                           ("beta gradient", beta, want[3])):
            err = float(np.max(np.abs(g - w)))
            _fail(out, err <= 1e-4, f"SyncBatchNormalization {mode} {what} differs by {err:.3g}")
        if mode == "eager":
            for what, a, c in (("moving_mean", sync.moving_mean, ref.moving_mean),
                               ("moving_variance", sync.moving_variance,
                                ref.moving_variance)):
                err = float(np.max(np.abs(np.asarray(a) - np.asarray(c))))
                _fail(out, err <= 1e-5, f"SyncBatchNormalization {what} differs by {err:.3g}")
            inferred = sync(full[mine], training=False).numpy()
            want_inf = ref(full, training=False).numpy()[mine]
            _fail(out, np.allclose(inferred, want_inf, atol=1e-5),
                  "SyncBatchNormalization inference does not use the moving statistics")
    return out


def check_best_model_checkpoint() -> list:
    """ddl.keras.callbacks.BestModelCheckpoint: only rank 0 writes, only on improvement
    (the file holds the best epoch's weights), and it needs best_model.filepath."""
    import tempfile
    import keras
    import ddl.keras as dk
    out = []
    r = hvd.rank()
    x, y = _data(16, seed=30)
    losses = iter([3.0, 1.0, 2.0])

    class FakeValLoss(keras.callbacks.Callback):  # val_loss: 3, 1, 2 (best: epoch 2)
        def on_epoch_end(self, epoch, logs=None):
            logs["val_loss"] = next(losses)
            self.model.weights_at.append([w.copy() for w in self.model.get_weights()])

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"rank{r}", "best.keras")
        model = _model(9)
        model.weights_at = []
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        best = dk.callbacks.BestModelCheckpoint(monitor="val_loss", mode="min")
        try:
            model.fit(x, y, epochs=1, verbose=0, callbacks=[best])
            out.append(f"rank {r}: BestModelCheckpoint trained without a filepath")
        except ValueError as exc:
            _fail(out, "best_model.filepath" in str(exc), f"no filepath: {exc}")
        best.filepath = path
        model.fit(x, y, epochs=3, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[FakeValLoss(), best])
        _fail(out, os.path.exists(path) == (r == 0),
              f"BestModelCheckpoint: file {'missing' if r == 0 else 'written'} on rank {r}")
        if r == 0 and os.path.exists(path):
            saved = keras.models.load_model(path).get_weights()
            _fail(out, all(np.array_equal(a, c) for a, c in zip(saved, model.weights_at[1])),
                  "BestModelCheckpoint did not keep the best epoch (2)")
    return out
