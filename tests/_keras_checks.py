"""Checks of ddl.keras as Horovod's own Keras tests use it (test_tensorflow2_keras.py,
test_keras.py, test_tensorflow2_keras_process_sets.py), run inside every rank of a world
of test_contract.py (the tcp world; the optimizer over a process set in the 3-rank shm
world). Each returns a list of failure strings."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import tensorflow as tf

import ddl.tensorflow as hvd
from _tf_checks import _data, _fail, _model


def _digests(variables) -> list:
    return hvd.allgather_object([np.asarray(v).tobytes() for v in variables])


def check_broadcast_callback() -> list:
    """BroadcastGlobalVariablesCallback: local_variables keep each rank's values; a rank
    that loaded a trained model and one that made a new model end with the root's model
    and optimizer state; a model built by its first batch is broadcast after it; ranks
    whose models differ all raise ValueError naming their variable counts."""
    import keras
    import ddl.keras as dk
    out = []
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    x, y = _data(4, seed=40)

    def constant_model(trainable):
        keras.utils.set_random_seed(0)
        init = keras.initializers.Constant(float(r))
        return keras.Sequential([keras.Input((5,))] + [
            keras.layers.Dense(k, kernel_initializer=init, bias_initializer=init,
                               trainable=trainable) for k in (3, 1)])

    model = constant_model(trainable=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    local = list(model.layers[0].variables)
    model.fit(x, y, epochs=1, verbose=0, callbacks=[
        dk.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)])
    for v in model.variables:
        want = r if any(v is w for w in local) else root
        _fail(out, np.allclose(np.asarray(v), want),
              f"broadcast with local_variables: {v.path} is {np.asarray(v).ravel()[:3]}, "
              f"want {want}")
    try:
        dk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.ones(2)])
        out.append(f"rank {r}: a non-variable in local_variables was accepted")
    except ValueError as exc:
        _fail(out, "local_variables must be variables" in str(exc), f"{exc}")

    # rank 0 loads a trained model (momentum and iterations restored), the others make a
    # new one: the callback builds their optimizers, then broadcasts
    def new_model():
        m = _model(50 + r)
        m.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="mse")
        return m

    with tempfile.TemporaryDirectory() as d:
        if r == 0:
            trained = _model(50)
            trained.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
            trained.fit(x, y, batch_size=2, epochs=1, verbose=0)
            trained.save(os.path.join(d, "m.keras"))
            model = dk.load_model(os.path.join(d, "m.keras"))
        else:
            model = new_model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[dk.callbacks.BroadcastGlobalVariablesCallback(0)])
    _fail(out, int(model.optimizer.iterations.numpy()) == 3,
          f"loaded/new: iterations {int(model.optimizer.iterations.numpy())}, want 2 + 1")
    every = _digests(model.variables + model.optimizer.variables)
    _fail(out, all(e == every[0] for e in every),
          "loaded/new: model and optimizer differ across ranks after the broadcast")

    # a model without an input shape is built by its first batch: broadcast after it
    keras.utils.set_random_seed(60 + r)
    lazy = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    lazy.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    lazy.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False,
             callbacks=[dk.callbacks.BroadcastGlobalVariablesCallback(root)])
    every = _digests(lazy.variables)
    _fail(out, len(lazy.variables) == 4 and all(e == every[0] for e in every),
          "a model built by its first batch differs across ranks after fit")

    odd = keras.Sequential([keras.Input((5,))]
                           + [keras.layers.Dense(1) for _ in range(1 + (r == 0))])
    odd.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    try:
        odd.fit(x, y, epochs=1, verbose=0,
                callbacks=[dk.callbacks.BroadcastGlobalVariablesCallback(0)])
        out.append(f"rank {r}: models of different sizes were broadcast")
    except ValueError as exc:
        _fail(out, "different numbers of model and optimizer variables (rank 0: 6, "
              "rank 1: 4)" in str(exc), f"different models: {exc}")
    return out


def check_lr_schedule() -> list:
    """LearningRateScheduleCallback's rates at given epochs and batches, as Horovod's
    (since 0.23): a number is exponential decay from start_epoch, per epoch or (staircase
    False) per batch; a function gives the factor; initial_lr is required."""
    import keras
    import ddl.keras as dk
    out = []
    x, y = _data(8, seed=42)
    steps = 2
    model = _model(42)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    decay = dk.callbacks.LearningRateScheduleCallback(initial_lr=0.8, multiplier=0.5,
                                                      start_epoch=1, end_epoch=3)
    smooth = dk.callbacks.LearningRateScheduleCallback(initial_lr=0.8, multiplier=0.5,
                                                       start_epoch=3, end_epoch=5,
                                                       staircase=False)
    factor = dk.callbacks.LearningRateScheduleCallback(initial_lr=0.8,
                                                       multiplier=lambda e: 0.25,
                                                       start_epoch=5)
    seen = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen[epoch] = round(float(np.asarray(self.model.optimizer.learning_rate)), 6)

    model.fit(x, y, batch_size=len(x) // steps, epochs=6, shuffle=False, verbose=0,
              callbacks=[decay, smooth, factor, Record()])
    _fail(out, decay.history == [(1, 0.8), (2, 0.4)], f"decay: {decay.history}")
    want = [(e + k / steps, 0.8 * 0.5 ** (e + k / steps - 3))
            for e in (3, 4) for k in range(steps)]
    _fail(out, len(smooth.history) == len(want) and all(
        abs(g[0] - w[0]) < 1e-9 and abs(g[1] - w[1]) < 1e-9
        for g, w in zip(smooth.history, want)), f"per batch: {smooth.history} vs {want}")
    _fail(out, seen == {0: 0.5, 1: 0.8, 2: 0.4, 3: round(0.8 * 0.5 ** 0.5, 6),
                        4: round(0.8 * 0.5 ** 1.5, 6), 5: 0.2}, f"rates by epoch: {seen}")
    try:
        dk.callbacks.LearningRateScheduleCallback(initial_lr=None, multiplier=0.5)
        out.append(f"rank {hvd.rank()}: initial_lr=None was accepted")
    except ValueError as exc:
        _fail(out, "needs initial_lr" in str(exc), f"initial_lr=None: {exc}")
    return out


def check_load_model_like_horovod() -> list:
    """load_model with Horovod's custom_objects: a function under the saved optimizer's
    name is called with its config, and an optimizer it (or its class's from_config) made
    distributed is not wrapped again (it keeps its own settings)."""
    import keras
    import ddl.keras as dk
    out = []
    r = hvd.rank()

    class Rms(keras.optimizers.RMSprop):
        pass

    class SelfWrapping(keras.optimizers.RMSprop):
        @classmethod
        def from_config(cls, config, custom_objects=None):
            return dk.DistributedOptimizer(cls(**config), backward_passes_per_step=3)

    x, y = _data(4, seed=43)
    for cls, objects in (
            (Rms, {"Rms": lambda **kw: dk.DistributedOptimizer(
                Rms(**kw), backward_passes_per_step=2)}),
            (SelfWrapping, {"SelfWrapping": SelfWrapping})):
        model = _model(43)
        model.compile(optimizer=cls(learning_rate=0.001), loss="mse")
        model.train_on_batch(x, y)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, f"m{r}.keras")
            model.save(path)
            try:
                loaded = dk.load_model(path, custom_objects=objects)
            except Exception as exc:  # noqa: BLE001 - reported as a failure
                out.append(f"rank {r}: load_model with custom_objects {objects}: "
                           f"{type(exc).__name__}: {exc}")
                continue
        opt = loaded.optimizer
        passes = 2 if cls is Rms else 3
        _fail(out, type(opt) is cls and getattr(opt, "_ddl_settings", {}).get(
            "backward_passes_per_step") == passes,
              f"load_model {cls.__name__}: {type(opt).__name__}, "
              f"{getattr(opt, '_ddl_settings', None)}")
        _fail(out, [np.asarray(v).tobytes() for v in opt.variables]
              == [np.asarray(v).tobytes() for v in model.optimizer.variables],
              f"load_model {cls.__name__}: the optimizer's state was not restored")
    return out


def check_optimizer_outside_its_process_set() -> list:
    """A DistributedOptimizer (Keras) and a DistributedGradientTape over a process set
    that Horovod's scripts make on every rank: the members average their gradients, a
    rank outside the set steps with its own (Horovod's test_process_set_optimizer)."""
    import keras
    import ddl.keras as dk
    out = []
    r, n = hvd.rank(), hvd.size()
    pair = hvd.add_process_set([0, n - 1])
    try:
        mine = float((r + 1) ** 2)  # 1 and n * n average to another rank's own
        want = (1 + n * n) / 2 if pair.included() else mine
        w = keras.Variable(np.zeros(2, np.float32))
        opt = dk.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=pair)
        opt.apply_gradients([(tf.fill([2], mine), w)])
        _fail(out, np.allclose(np.asarray(w), -want),
              f"Keras optimizer over {pair}: w = {np.asarray(w)}, want {-want}")
        v = tf.Variable(np.ones(2, np.float32))
        with tf.GradientTape() as tape:
            loss = mine * tf.reduce_sum(v)
        grad, = hvd.DistributedGradientTape(tape, process_set=pair).gradient(loss, [v])
        _fail(out, np.allclose(grad.numpy(), want),
              f"tape over {pair}: gradient {grad.numpy()}, want {want}")
    finally:
        hvd.remove_process_set(pair)
    return out


def check_no_xla() -> list:
    """ddl's collectives are host callbacks XLA cannot compile: a model with a ddl
    optimizer is one Keras does not compile with XLA (jit_compile="auto", the default,
    does on a GPU machine; True gets Keras's warning and False), and a collective traced
    into tf.function(jit_compile=True) raises at once, on every rank, saying what to do."""
    import warnings

    import keras
    import ddl.keras as dk
    from keras.src.trainers import trainer
    out = []
    r = hvd.rank()
    x, y = _data(4, seed=41)

    def model():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])

    plain, dist = model(), model()
    plain.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dist.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                     jit_compile=True)
    _fail(out, trainer.model_supports_jit(plain) and not trainer.model_supports_jit(dist)
          and dist.jit_compile is False
          and any("jit_compile" in str(w.message) for w in said),
          f"XLA: plain {trainer.model_supports_jit(plain)}, ddl "
          f"{trainer.model_supports_jit(dist)}, jit_compile {dist.jit_compile}")
    history = dist.fit(x, y, batch_size=2, epochs=1, verbose=0)
    _fail(out, np.isfinite(history.history["loss"][-1]), "fit after jit_compile=True")

    @tf.function(jit_compile=True)
    def compiled(t):
        return hvd.allreduce(t, name="xla/sum")
    try:
        compiled(tf.ones(3))
        out.append(f"rank {r}: an allreduce in a jit_compile function did not raise")
    except ValueError as exc:
        _fail(out, "XLA cannot compile" in str(exc) and "jit_compile=False" in str(exc),
              f"allreduce under XLA: {exc}")
    return out


def check_mixed_precision_overflow() -> list:
    """Under mixed_float16 Keras puts a LossScaleOptimizer around the ddl optimizer: when
    one rank's gradients overflow, every rank skips that step (Horovod's outcome), so the
    ranks stay in step with the same weights; before, the ranks took different branches
    and stalled."""
    import keras
    import ddl.keras as dk
    out = []
    r = hvd.rank()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=dk.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse")
        x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
        if r == 1:
            x[:2] = 6e4   # overflows float16 in this rank's first batch of each epoch
        model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False,
                  callbacks=[dk.callbacks.BroadcastGlobalVariablesCallback(0)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    steps = int(model.optimizer.iterations)
    _fail(out, isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
          and steps == 6, f"steps taken {steps} (8 batches, 2 skipped on every rank)")
    digests = _digests(model.trainable_variables)
    _fail(out, all(d == digests[0] for d in digests), "the ranks' weights differ")
    return out
