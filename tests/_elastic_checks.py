"""Checks of the framework elastic states in one 2-rank world without elastic (plain
``ddlrun -np 2 python tests/_elastic_checks.py FRAMEWORK``, FRAMEWORK one of torch, keras,
jax): each rank starts from a different state; ``commit`` saves, ``restore`` rolls back
to the last commit (twice in a row too: the saved copy is not aliased by the live state),
``sync`` gives every rank rank 0's state (and saves it), ``ddl.elastic.run`` syncs and
calls once, ``on_reset`` runs ``reset`` and the callbacks; a collective failing inside a
compiled program (``tf.function``, ``jax.jit``) reaches the caller of the client's
``elastic.run`` as ddl's typed error. Prints ``ELASTIC CHECKS OK``
on rank 0, or every failure (exit 1).
"""

from __future__ import annotations

import sys

import numpy as np

import ddl
import ddl.elastic

fails = []


def check(cond, what):
    if not cond:
        fails.append(f"rank {ddl.rank()}: {what}")


def same_on_every_rank(value, what):
    everyone = ddl.allgather_object(value, name=f"check/{what}")
    check(all(_equal(v, everyone[0]) for v in everyone), f"{what} differs across ranks: "
          f"{everyone}")


def _equal(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def object_state():
    r = ddl.rank()
    state = ddl.elastic.ObjectState(epoch=r * 10, weights=np.full(3, float(r)))
    state.epoch += 1
    state.weights[0] = 7.0  # in place: the saved copy must not change
    state.restore()
    check(state.epoch == r * 10 and np.array_equal(state.weights, np.full(3, float(r))),
          f"ObjectState.restore: {state.epoch}, {state.weights}")
    state.epoch = 5 + r
    state.commit()
    state.epoch = 99
    state.restore()
    check(state.epoch == 5 + r, f"ObjectState: restore after commit gave {state.epoch}")
    state.sync()
    check(state.epoch == 5 and np.array_equal(state.weights, np.zeros(3)),
          f"ObjectState.sync: {state.epoch}, {state.weights}")


# -- torch ----------------------------------------------------------------------------------

def torch_checks():
    import torch
    import ddl.torch as hvd

    r = hvd.rank()
    torch.manual_seed(100 + r)  # every rank starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = hvd.elastic.ElasticSampler(range(40), seed=1)
    check(len(sampler) == 20 and sampler.num_replicas == 2 and sampler.rank == r,
          f"ElasticSampler shards over ddl's world: {len(sampler)}, {sampler.num_replicas}")

    def step():
        x = torch.randn(8, 4)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def snapshot():
        return {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "opt": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                        for k, s in opt.state_dict()["state"].items()},
                "lr": opt.param_groups[0]["lr"], "sched": sched.state_dict()["last_epoch"]}

    def same(a, b):
        return (a["model"].keys() == b["model"].keys() and
                all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and
                a["opt"].keys() == b["opt"].keys() and
                all(torch.equal(a["opt"][k][n], b["opt"][k][n]) if torch.is_tensor(
                    a["opt"][k][n]) else a["opt"][k][n] == b["opt"][k][n]
                    for k in a["opt"] for n in a["opt"][k]) and
                a["lr"] == b["lr"] and a["sched"] == b["sched"])

    step()
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, scheduler=sched,
                                   epoch=r * 10, extra={"r": r})
    check(state.model is model and state.optimizer is opt and state.epoch == r * 10,
          "TorchState attributes")
    committed = snapshot()
    committed_indices = set(sampler.processed_indices)
    # change everything, then roll back
    step()
    sched.step()
    state.epoch = 77
    state.extra["r"] = 55
    sampler.record_batch(0, 4)
    check(not same(snapshot(), committed), "the training step changed nothing")
    state.restore()
    check(same(snapshot(), committed), "TorchState.restore did not roll model, optimizer "
          "and scheduler back to the commit")
    check(state.epoch == r * 10 and state.extra == {"r": r} and
          sampler.processed_indices == committed_indices,
          f"TorchState.restore: epoch {state.epoch}, extra {state.extra}, sampler "
          f"{sorted(sampler.processed_indices)}")
    step()  # Adam updates its state in place: the saved copy must not follow
    state.restore()
    check(same(snapshot(), committed), "a second restore differs: the saved optimizer "
          "state was aliased by the live one")
    # commit, change, restore
    step()
    sampler.record_batch(1, 4)
    state.epoch = 3 + r
    state.commit()
    committed, committed_indices = snapshot(), set(sampler.processed_indices)
    step()
    state.epoch = 1000
    sampler.record_batch(2, 4)
    state.restore()
    check(same(snapshot(), committed) and state.epoch == 3 + r and
          sampler.processed_indices == committed_indices, "restore after commit")
    # sync: rank 0's everything on every rank; processed indices: rank 0's, and what
    # each rank recorded itself; a batch rank 1 alone recorded (it committed a step that
    # rank 0 rolled back) is trained again, as rank 0's model never learned from it
    sampler.record_indices([30 + r])
    union = set(sampler.processed_indices) | {30, 31}
    if r == 1:
        sampler.record_batch(3, 4)
    state.sync()
    mine = snapshot()
    everyone = hvd.allgather_object({k: {n: t.tolist() for n, t in v.items()} if k == "model"
                                     else v for k, v in mine.items() if k != "opt"},
                                    name="check/torch-sync")
    check(everyone[0] == everyone[1], f"TorchState.sync left ranks different: {everyone}")
    same_on_every_rank({k: {n: t.tolist() if torch.is_tensor(t) else t
                            for n, t in s.items()} for k, s in mine["opt"].items()},
                       "optimizer state after sync")
    check(state.epoch == 3 and state.extra == {"r": 0} and opt.param_groups[0]["lr"] ==
          everyone[0]["lr"], f"TorchState.sync: epoch {state.epoch}, extra {state.extra}")
    check(sampler.processed_indices == union and len(sampler.remaining_indices) ==
          40 - len(union), f"ElasticSampler.sync: {sorted(sampler.processed_indices)}")
    step()
    state.epoch = 9
    state.restore()  # sync saved: the rollback point is rank 0's state
    check(same(snapshot(), mine) and state.epoch == 3, "restore after sync")
    # reset: the sampler re-shards what is left; then the reset callbacks run
    seen = []
    state.register_reset_callbacks([lambda: seen.append("a"), lambda: seen.append("b")])
    sampler.record_batch(0, 2)
    before = len(sampler.remaining_indices)
    state.on_reset()
    check(seen == ["a", "b"] and len(sampler.remaining_indices) == before - 4,
          f"on_reset: callbacks {seen}, {before} -> {len(sampler.remaining_indices)} left")
    # run outside an elastic job: sync, then one call
    state.epoch = 40 + r

    @hvd.elastic.run
    def train(state, extra, *, key):
        return state.epoch, extra, key, hvd.size()

    got = train(state, "x", key=r)
    check(got == (40, "x", r, 2), f"ddl.elastic.run without elastic: {got}")
    try:
        hvd.elastic.TorchState(model, commit=1)
    except ValueError as e:
        check("['commit'] cannot be state names" in str(e), str(e))
    else:
        check(False, "TorchState(commit=...) was accepted")


# -- keras ----------------------------------------------------------------------------------

def keras_checks():
    import keras
    import tensorflow as tf
    import ddl.keras as hvd

    r = hvd.rank()
    keras.utils.set_random_seed(200 + r)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01 * (r + 1))),
                  loss="mse")
    x = np.random.default_rng(r).standard_normal((16, 4)).astype(np.float32)
    y = np.random.default_rng(10 + r).standard_normal((16, 1)).astype(np.float32)

    def values():
        return [v.numpy().copy() for v in model.variables + model.optimizer.variables]

    def same(a, b):
        return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))

    state = hvd.elastic.KerasState(model, epoch=r, batch=0)
    check(model.optimizer.built and len(values()) > len(model.variables),
          "KerasState builds the optimizer, so that its variables can be saved")
    committed = values()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.epoch = 50
    check(not same(values(), committed), "fit changed nothing")
    state.restore()
    check(same(values(), committed) and state.epoch == r, "KerasState.restore")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.commit()
    committed = values()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.restore()
    check(same(values(), committed), "KerasState.restore after commit")
    state.sync()
    same_on_every_rank([v.tolist() for v in values()], "Keras variables after sync")
    check(state.epoch == 0, f"KerasState.sync: epoch {state.epoch}")
    import ddl.tensorflow   # Horovod's TensorFlow spelling, as its elastic examples use it
    tf_state = ddl.tensorflow.elastic.TensorFlowKerasState(model, model.optimizer,
                                                           backend=None, batch=7)
    check(issubclass(hvd.elastic.KerasState, type(tf_state)) and tf_state.batch == 7
          and len(tf_state.tracked_variables()) == len(values()), "TensorFlowKerasState")
    # the callbacks, through fit: 4 batches an epoch, 2 epochs, a commit every 3 batches
    # and at the end of each epoch (the count starts again there)
    commits = []
    state.commit = lambda: commits.append((state.epoch, state.batch))
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=3)]
    model.fit(x, y, batch_size=4, epochs=3, initial_epoch=1, verbose=0, callbacks=callbacks)
    check(commits == [(0, 3), (2, 0), (2, 3), (3, 0)] and state.epoch == 3 and
          state.batch == 0, f"callbacks: commits {commits}, epoch {state.epoch}")
    del state.commit
    try:
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)
    except ValueError as e:
        check("batches_per_commit must be >= 1, got 0" in str(e), str(e))
    else:
        check(False, "batches_per_commit=0 was accepted")
    # a collective failing inside a graph reaches run's caller as ddl's own error
    @tf.function
    def mismatched():
        return hvd.allreduce(tf.ones([2 + r]), name="elastic/mismatch")

    @hvd.elastic.run
    def train(state):
        return mismatched()

    _expect_mismatch(lambda: train(state), "tf.function")


# -- jax ------------------------------------------------------------------------------------

def jax_checks():
    import jax.numpy as jnp
    import optax
    import ddl.jax as hvd

    r = hvd.rank()
    params = {"w": jnp.full((3, 2), float(r)), "b": jnp.arange(2.0) + r}
    tx = optax.adam(0.1)
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), step=r,
                                 host=np.full(2, float(r)))

    def update():
        grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
        updates, state.opt_state = tx.update(grads, state.opt_state, state.params)
        state.params = optax.apply_updates(state.params, updates)
        state.step += 1
        state.host[0] += 1  # a NumPy leaf changed in place

    update()
    state.restore()
    check(np.array_equal(state.params["w"], np.full((3, 2), float(r))) and state.step == r
          and np.array_equal(state.host, np.full(2, float(r))) and
          int(state.opt_state[0].count) == 0, "JaxState.restore")
    update()
    state.commit()
    committed = (np.asarray(state.params["w"]).copy(), state.step, state.host.copy())
    update()
    update()
    state.restore()
    check(np.array_equal(state.params["w"], committed[0]) and state.step == committed[1] and
          np.array_equal(state.host, committed[2]) and int(state.opt_state[0].count) == 1,
          "JaxState.restore after commit")
    state.sync()
    same_on_every_rank([np.asarray(state.params["w"]).tolist(),
                        np.asarray(state.opt_state[0].mu["b"]).tolist(), state.step,
                        state.host.tolist()], "JaxState after sync")
    check(state.step == 1 and np.array_equal(state.host, [1.0, 0.0]),
          f"JaxState.sync: step {state.step}, host {state.host}")
    update()
    state.restore()
    check(state.step == 1, "restore after sync")

    @hvd.elastic.run
    def train(state):
        return state.step, hvd.size()

    state.step = 10 + r
    check(train(state) == (10, 2), "ddl.elastic.run without elastic")
    # a flax nnx Module as a value: updated in place
    from flax import nnx
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(r))
    held = hvd.elastic.JaxState(layer=layer)
    w0 = np.asarray(layer.kernel.value).copy()
    layer.kernel.value = layer.kernel.value + 1.0
    held.restore()
    check(held.layer is layer and np.array_equal(np.asarray(layer.kernel.value), w0),
          "JaxState.restore of an nnx Module")
    held.sync()
    same_on_every_rank(np.asarray(layer.kernel.value).tolist(), "nnx Module after sync")
    # a collective failing inside jax.jit reaches run's caller as ddl's own error
    import jax
    mismatched = jax.jit(lambda v: hvd.allreduce(v, name="elastic/mismatch"))

    @hvd.elastic.run
    def train_jit(state):
        return mismatched(jnp.ones(2 + r)).block_until_ready()

    _expect_mismatch(lambda: train_jit(state), "jax.jit")


def _expect_mismatch(fn, where):
    try:
        fn()
    except ddl.MismatchError as e:
        check("elastic/mismatch" in str(e), f"MismatchError without the name: {e}")
    except Exception as e:  # noqa: BLE001
        check(False, f"a MismatchError inside {where} came back as {type(e).__name__}: "
                     f"{str(e)[:300]}")
    else:
        check(False, f"the mismatched allreduce inside {where} succeeded")


def main():
    framework = sys.argv[1]
    ddl.init()
    parts = {"torch": (object_state, torch_checks), "keras": (keras_checks,),
             "jax": (jax_checks,)}[framework]
    for part in parts:
        try:
            part()
        except Exception as e:  # noqa: BLE001 - report, and go on with the other parts
            import traceback
            fails.append(f"rank {ddl.rank()}: {part.__name__} raised {type(e).__name__}: "
                         f"{e}\n{traceback.format_exc()[-1500:]}")
    everyone = ddl.allgather_object(fails, name="check/fails")
    rank = ddl.rank()
    ddl.shutdown()
    problems = [f for per_rank in everyone for f in per_rank]
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    if rank == 0:
        print("ELASTIC CHECKS OK")


if __name__ == "__main__":
    main()
