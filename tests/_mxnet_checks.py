"""Checks of ddl.mxnet (and the collective contract over NDArrays), run in every rank of
one 2-rank world in the MXNet environment:
``ddlrun -np 2 python tests/_mxnet_checks.py`` prints ``MXNET CHECKS OK`` on rank 0 or
every failure (and exits 1)."""

from __future__ import annotations

import sys

import mxnet as mx
import numpy as np

import ddl.mxnet as hvd

fails = []


def check(cond, what):
    if not cond:
        fails.append(f"rank {hvd.rank()}: {what}")


def collectives():
    r, n = hvd.rank(), hvd.size()
    for dt in ("float32", "float64", "float16", "int32", "int64", "uint8", "int8"):
        x = mx.nd.array(np.arange(6).reshape(2, 3) + r, dtype=dt)
        s = hvd.allreduce(x, op=hvd.Sum, name=f"s/{dt}")
        want = sum(np.arange(6).reshape(2, 3) + k for k in range(n)).astype(dt)
        check(isinstance(s, mx.nd.NDArray) and s.dtype == np.dtype(dt) and
              np.array_equal(s.asnumpy(), want) and s.context == x.context, f"allreduce {dt}")
        g = hvd.allgather(mx.nd.ones((r + 1, 2), dtype=dt) * r, name=f"g/{dt}")
        check(g.shape == (n * (n + 1) // 2, 2) and g.dtype == np.dtype(dt), f"allgather {dt}")
        b = hvd.broadcast(x, root_rank=n - 1, name=f"b/{dt}")
        check(np.array_equal(b.asnumpy(), (np.arange(6).reshape(2, 3) + n - 1).astype(dt)),
              f"broadcast {dt}")
        check(np.array_equal(x.asnumpy(), (np.arange(6).reshape(2, 3) + r).astype(dt)),
              f"input unchanged {dt}")
    y = mx.nd.ones(5) * (r + 1)
    hvd.allreduce_(y, name="inplace")  # Average
    check(np.allclose(y.asnumpy(), (n + 1) / 2), f"allreduce_ {y.asnumpy()}")
    z = mx.nd.ones(3) * r
    hvd.broadcast_(z, root_rank=0, name="b_inplace")
    check(np.allclose(z.asnumpy(), 0), "broadcast_")
    h = hvd.allreduce_async(mx.nd.ones(4) * r, op=hvd.Sum, name="async")
    check(np.allclose(hvd.synchronize(h).asnumpy(), n * (n - 1) / 2), "allreduce_async")
    a = hvd.alltoall(mx.nd.array(np.arange(n) + 10 * r), name="a2a")  # no splits: the rows
    check(a.asnumpy().tolist() == [10 * k + r for k in range(n)], f"alltoall {a}")
    a, splits = hvd.alltoall(mx.nd.array(np.arange(n) + 10 * r), splits=[1] * n, name="a2a_s")
    check(a.asnumpy().tolist() == [10 * k + r for k in range(n)]
          and isinstance(splits, mx.nd.NDArray) and splits.dtype == np.int32
          and splits.asnumpy().tolist() == [1] * n, f"alltoall with splits {a} {splits}")
    rs = hvd.reducescatter(mx.nd.ones((2 * n, 2)), op=hvd.Sum, name="rs")
    check(rs.shape == (2, 2) and np.allclose(rs.asnumpy(), n), "reducescatter")
    gr = hvd.grouped_allreduce_([mx.nd.ones(2) * r, mx.nd.ones(3) * 2 * r], op=hvd.Sum,
                                name="grouped")
    check(np.allclose(gr[1].asnumpy(), n * (n - 1)), "grouped_allreduce_")
    ga = hvd.grouped_allgather([mx.nd.ones((r + 1, 2)) * r, mx.nd.ones(1)], name="g_ag")
    grs = hvd.grouped_reducescatter([mx.nd.ones((n, 3)) * (r + 1)], op=hvd.Max,
                                    name="g_rs")
    check(isinstance(ga[0], mx.nd.NDArray) and ga[0].shape == (n * (n + 1) // 2, 2)
          and ga[1].shape == (n,) and grs[0].shape == (1, 3)
          and np.allclose(grs[0].asnumpy(), n), f"grouped allgather/reducescatter {grs}")
    rs = hvd.reducescatter(mx.nd.ones((n, 2)), op=hvd.Sum, name="rs_pre", prescale_factor=3)
    check(np.allclose(rs.asnumpy(), 3 * n), "reducescatter prescale")
    # Horovod's positions: (tensor, average, name, priority, ...), (tensor, root, name, priority)
    s = hvd.allreduce(mx.nd.ones(3) * (r + 1), False, "pos/sum", 5)
    b = hvd.broadcast(mx.nd.ones(2) * r, n - 1, "pos/bcast", 1)
    g = hvd.allgather(mx.nd.ones((1, 2)) * r, "pos/gather", 2)
    check(np.allclose(s.asnumpy(), n * (n + 1) / 2) and np.allclose(b.asnumpy(), n - 1)
          and g.shape == (n, 2), "Horovod's positional arguments")
    h = hvd.allreduce_async(mx.nd.ones(2), op=hvd.Sum, name="polled")
    hvd.synchronize(h)
    check(hvd.poll(h) and hvd.gloo_enabled() is False, "poll, gloo_enabled")


def _net(seed):
    mx.random.seed(seed)
    np.random.seed(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(8, activation="tanh"), mx.gluon.nn.Dense(1))
    net.initialize(mx.init.Xavier())  # deferred: shapes known at the first forward
    return net


def trainer_contract():
    """2 ranks at batch b == 1 rank at batch 2b after 3 steps (1e-5); broadcast of
    deferred parameters; identical parameters on every rank."""
    r, n = hvd.rank(), hvd.size()
    b, steps = 4, 3
    rng = np.random.default_rng(7)
    x = rng.standard_normal((steps * n * b, 5)).astype(np.float32)
    y = rng.standard_normal((steps * n * b, 1)).astype(np.float32)
    loss_fn = mx.gluon.loss.L2Loss()
    # different initial weights on every rank; the broadcast of these deferred
    # parameters happens at the first forward
    dist = _net(100 + r)
    hvd.broadcast_parameters(dist.collect_params(), root_rank=0)
    dist(mx.nd.array(x[:1]))
    digests = hvd.allgather_object([p.data().asnumpy().tobytes()
                                    for _, p in sorted(dist.collect_params().items())])
    check(all(d == digests[0] for d in digests), "deferred parameters not broadcast")
    ref = _net(1)  # the one-rank reference starts from the same (rank 0's) weights
    ref(mx.nd.array(x[:1]))
    for (_, p), (_, q) in zip(sorted(ref.collect_params().items()),
                              sorted(dist.collect_params().items())):
        p.set_data(q.data().copy())
    ref_trainer = mx.gluon.Trainer(ref.collect_params(), "sgd",
                                   {"learning_rate": 0.1, "momentum": 0.5})
    trainer = hvd.DistributedTrainer(dist.collect_params(), "sgd",
                                     {"learning_rate": 0.1, "momentum": 0.5}, prefix="t1")
    for k in range(steps):
        full = slice(k * n * b, (k + 1) * n * b)
        with mx.autograd.record():
            loss = loss_fn(ref(mx.nd.array(x[full])), mx.nd.array(y[full]))
        loss.backward()
        ref_trainer.step(n * b)
        mine = slice(k * n * b + r * b, k * n * b + (r + 1) * b)
        with mx.autograd.record():
            loss = loss_fn(dist(mx.nd.array(x[mine])), mx.nd.array(y[mine]))
        loss.backward()
        trainer.step(b)
    for (name, p), q in zip(sorted(dist.collect_params().items()),
                            [v for _, v in sorted(ref.collect_params().items())]):
        err = float(np.max(np.abs(p.data().asnumpy() - q.data().asnumpy())))
        check(err <= 1e-5, f"trainer contract: {name} differs by {err:.3g}")
    digests = hvd.allgather_object([p.data().asnumpy().tobytes()
                                    for _, p in sorted(dist.collect_params().items())])
    check(all(d == digests[0] for d in digests), "parameters differ across ranks")


def optimizer_wrapper():
    """DistributedOptimizer averages before the update: SGD without momentum, lr 1."""
    r, n = hvd.rank(), hvd.size()
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), num_groups=1)
    w = mx.nd.zeros(3)
    state = opt.create_state(0, w)
    opt.update(0, w, mx.nd.ones(3) * (r + 1), state)
    check(np.allclose(w.asnumpy(), -(n + 1) / 2), f"DistributedOptimizer {w.asnumpy()}")
    class Outside:  # a set of two or more this rank is not in (the world has two ranks)
        def size(self):
            return 2

        def included(self):
            return False

    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), process_set=Outside())
    w = mx.nd.zeros(3)
    opt.update(0, w, mx.nd.ones(3) * (r + 1), opt.create_state(0, w))
    check(np.allclose(w.asnumpy(), -(r + 1)), f"outside its process set {w.asnumpy()}")
    arrays = {"a": mx.nd.ones(2) * r, "b": mx.nd.ones((2, 2)) * (r + 5)}
    hvd.broadcast_parameters(arrays, root_rank=1, prefix="arrays")
    check(np.allclose(arrays["a"].asnumpy(), 1) and np.allclose(arrays["b"].asnumpy(), 6),
          "broadcast_parameters of NDArrays")


def optimizer_in_trainer():
    """A DistributedOptimizer inside a plain Gluon Trainer takes what the Trainer sets on
    it (rescale_grad = 1/batch, param_dict and so wd_mult), and survives save/load_states;
    a DistributedTrainer given one unwraps it with a warning. SGD, lr 1, wd 0.5."""
    import tempfile
    import warnings
    r, n = hvd.rank(), hvd.size()

    def step(make_trainer, tag):
        net = mx.gluon.nn.Dense(1, in_units=2, weight_initializer=mx.init.Constant(0.5),
                                bias_initializer=mx.init.Constant(1.0))
        net.initialize()
        net.bias.wd_mult = 0.0
        trainer = make_trainer(net.collect_params())
        with mx.autograd.record():
            loss = net(mx.nd.ones((4, 2)) * (r + 1)).sum()
        loss.backward()
        trainer.step(4)  # averaged weight gradient 2(n+1), over 4: (n+1)/2; bias: 1
        check(np.allclose(net.weight.data().asnumpy(), 0.5 - ((n + 1) / 2 + 0.25))
              and np.allclose(net.bias.data().asnumpy(), 0.0),
              f"{tag}: weight {net.weight.data().asnumpy()} bias {net.bias.data().asnumpy()}")
        return trainer

    def sgd():
        return hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0, wd=0.5))

    trainer = step(lambda p: mx.gluon.Trainer(p, sgd(), kvstore=None),
                   "DistributedOptimizer in a Gluon Trainer")
    with tempfile.TemporaryDirectory() as d:
        trainer.save_states(f"{d}/states")
        trainer.load_states(f"{d}/states")
    check(isinstance(trainer._optimizer, hvd.DistributedOptimizer)
          and trainer._optimizer.rescale_grad == 0.25, "Trainer.save_states/load_states")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(lambda p: hvd.DistributedTrainer(p, sgd(), prefix="unwrap"),
             "DistributedTrainer given a DistributedOptimizer")
    check(any("DistributedTrainer reduces gradients itself" in str(w.message) for w in caught),
          "no warning when a DistributedTrainer unwraps a DistributedOptimizer")


def contract():
    """The collective contract of tests/_contract_checks.py over NDArrays (the MXNet
    entry of tests/arrayimpl.py; the other libraries run in test_contract.py)."""
    import arrayimpl
    import _contract_checks
    impl = next(i for i in arrayimpl.IMPLS if i.name == "mxnet")
    fails.extend(_contract_checks.check_library(impl) + _contract_checks.check_mismatches(impl))


def main() -> int:
    hvd.init()
    for part in (collectives, trainer_contract, optimizer_wrapper, optimizer_in_trainer,
                 contract):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - reported below
            fails.append(f"rank {hvd.rank()}: {part.__name__} raised {type(exc).__name__}: "
                         f"{exc}")
    every = hvd.allgather_object(fails)
    flat = [f for per_rank in every for f in per_rank]
    if hvd.rank() == 0:
        print("\n".join(flat) if flat else "MXNET CHECKS OK", flush=True)
    hvd.shutdown()
    return 1 if flat else 0


if __name__ == "__main__":
    sys.exit(main())
