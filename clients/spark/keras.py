"""Horovod's ``horovod.spark.keras`` on ddl: :class:`KerasEstimator` trains a Keras 3
model on a Spark DataFrame as one ddl job of ``num_proc`` Spark tasks, and returns a
:class:`KerasModel` whose ``transform(df)`` adds the model's outputs as columns.

::

    from ddl.spark.common.store import Store
    from ddl.spark.keras import KerasEstimator
    est = KerasEstimator(num_proc=4, store=Store.create("/shared/ddl"), model=model,
                         optimizer=keras.optimizers.Adam(1e-3), loss="mse",
                         metrics=["mae"], feature_cols=["features"], label_cols=["y"],
                         batch_size=32, epochs=10, validation=0.1)
    fitted = est.fit(train_df)          # a KerasModel
    pred = fitted.transform(test_df)    # test_df with a "y__output" column

A fit writes the columns into the store and gives each rank its equal share of the rows
as :mod:`ddl.spark.torch` does; each rank compiles the model with
``ddl.keras.DistributedOptimizer(optimizer)`` and runs ``model.fit`` with
``BroadcastGlobalVariablesCallback(0)`` (rank 0's initial weights everywhere) and
``MetricAverageCallback`` (the epoch's metrics averaged over the ranks), then the
``callbacks`` given. Each feature column is one input of the model (one array for a
single column), reshaped to the model's input shape where it holds as many values per
row (a flat vector into an image input); each label column is one output;
``sample_weight_col`` weighs the rows.
The model travels to the ranks as its JSON config and weights, the optimizer as its
config (``keras.optimizers.serialize``): custom layers, losses or optimizers go in
``custom_objects``, and their code must be importable on the executors.

After every epoch rank 0 writes a checkpoint (the weights, the history, the epoch) to
``store.get_checkpoint_path(run_id)``; a fit with the ``run_id`` of an unfinished run
resumes with those weights after that epoch (the optimizer's own state, such as Adam's
moments, starts afresh, unlike the torch estimator's). ``getHistory()`` is Keras'
history of the fit.
"""

from __future__ import annotations

import io
import json
import uuid
from typing import Any, Callable, Dict, List, Mapping, Tuple

import keras
import numpy as np

from ddl.spark._data import prepare, read_shard, shared_checkpoint
from ddl.spark._estimator import SparkEstimator, SparkModel, per_column

__all__ = ["KerasEstimator", "KerasModel"]

_READER_KNOBS = ("shuffle_buffer_size", "partitions_per_process",
                 "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type",
                 "inmemory_cache_all")


class KerasEstimator(SparkEstimator):
    """Horovod's ``KerasEstimator``: a Spark ML Estimator whose ``fit(df)`` trains ``model``
    on ``num_proc`` Spark tasks as one ddl job and returns a :class:`KerasModel` (see the
    module doc). Its arguments, all keywords, each with Horovod's ``getX``/``setX``:

    ``num_proc`` (default: Spark's default parallelism), ``model``, ``optimizer`` (a
    Keras 3 optimizer), ``loss`` (what ``compile`` takes: a name, a function, or one
    per output), ``loss_weights``, ``metrics``, ``custom_objects``, ``store``,
    ``feature_cols``, ``label_cols``, ``sample_weight_col``, ``label_shapes``,
    ``validation`` (a fraction or a column name), ``batch_size`` (32),
    ``val_batch_size``, ``epochs`` (1), ``train_steps_per_epoch``,
    ``validation_steps_per_epoch``, ``shuffle`` (True), ``random_seed``, ``callbacks``
    (Keras callbacks, after ddl's), ``gradient_compression``,
    ``backward_passes_per_step``, ``run_id``, ``verbose`` (1: rank 0's Keras progress).

    Instead of ``num_proc``, ``backend``: a :class:`ddl.spark.common.backend.SparkBackend`
    (its ``num_proc``, environment and output streams). Horovod's data-reader knobs
    (``shuffle_buffer_size``, ``partitions_per_process``, ``*_reader_num_workers``,
    ``reader_pool_type``, ``inmemory_cache_all``) are accepted and change nothing;
    ``transformation_fn`` and ``checkpoint_callback`` raise ValueError."""

    DEFAULTS = dict(num_proc=None, backend=None, model=None, optimizer=None, loss=None,
                    loss_weights=None, metrics=None, custom_objects=None, store=None,
                    feature_cols=None, label_cols=None, sample_weight_col=None, label_shapes=None,
                    validation=None, batch_size=32, val_batch_size=None, epochs=1,
                    train_steps_per_epoch=None, validation_steps_per_epoch=None, shuffle=True,
                    random_seed=None, callbacks=None, gradient_compression=None,
                    backward_passes_per_step=1, run_id=None, verbose=1)
    ACCEPTED = _READER_KNOBS
    REFUSED = {"transformation_fn": "transform the DataFrame before fit",
               "checkpoint_callback": "rank 0 checkpoints every epoch into the store; add "
                                      "your own callback to callbacks"}

    def _fit(self, df: Any) -> "KerasModel":
        v = self._values
        who = "KerasEstimator.fit"
        store, features, labels, run_id = self._common(df)
        if not isinstance(v["model"], keras.Model):
            raise ValueError(f"{who}: model must be a keras.Model, got "
                             f"{type(v['model']).__name__}")
        if not isinstance(v["optimizer"], keras.optimizers.Optimizer):
            raise ValueError(f"{who}: optimizer must be a Keras 3 optimizer, got "
                             f"{type(v['optimizer']).__name__}")
        if v["loss"] is None:
            raise ValueError(f"{who}: loss is required")
        weight = v["sample_weight_col"]
        columns = features + labels + ([weight] if weight else [])
        data = prepare(df, store, columns, v["validation"], seed=v["random_seed"] or 0)
        custom = v["custom_objects"] or {}
        with keras.saving.custom_object_scope(custom):
            model_json = v["model"].to_json()
            optimizer = keras.optimizers.serialize(v["optimizer"])
        spec = {"model": (model_json, _save_weights(v["model"].get_weights())),
                "optimizer": optimizer, "loss": v["loss"],
                "loss_weights": v["loss_weights"], "metrics": v["metrics"],
                "custom_objects": custom, "store": store, "data": data,
                "features": features, "labels": labels, "weight": weight,
                "label_shapes": per_column(who, "label_shapes", v["label_shapes"], labels),
                **self._schedule(), "callbacks": list(v["callbacks"] or []),
                "compression": v["gradient_compression"],
                "backward_passes_per_step": v["backward_passes_per_step"],
                "run_id": run_id, "verbose": v["verbose"]}
        results = self._train_on_spark(df, _train, spec)
        model = _clone(v["model"], spec["custom_objects"])
        model.set_weights(_load_weights(results[0]["weights"])[0])
        return KerasModel(model=model, history=results[0]["history"], feature_cols=features,
                          label_cols=labels, custom_objects=spec["custom_objects"],
                          run_id=run_id)


class KerasModel(SparkModel):
    """What :meth:`KerasEstimator.fit` returns (Horovod's ``KerasModel``):
    ``getModel()`` (the trained ``keras.Model``), ``getHistory()``
    (``{"loss": [...], "val_loss": [...], ...}``), ``getRunId()``; ``transform(df)``
    adds ``output_cols`` (``setOutputCols``)."""

    DEFAULTS = dict(model=None, history=None, feature_cols=None, label_cols=None,
                    output_cols=None, custom_objects=None, run_id=None)

    def _predictor(self) -> Callable[[List[Any]], List[Any]]:
        with keras.saving.custom_object_scope(self._values["custom_objects"] or {}):
            packed = (self._values["model"].to_json(),
                      _save_weights(self._values["model"].get_weights()))
        custom = self._values["custom_objects"] or {}
        key = uuid.uuid4().hex
        return lambda arrays: _predict(key, packed, custom, arrays)


_MODELS: Dict[str, Any] = {}  # in an executor's Python worker: the models built lately
_MODELS_KEPT = 4


def _predict(key: str, packed: Any, custom: Mapping[str, Any], arrays: List[Any]) -> List[Any]:
    model = _MODELS.get(key)
    if model is None:
        model = keras.models.model_from_json(packed[0], custom_objects=dict(custom))
        model.set_weights(_load_weights(packed[1])[0])
        while len(_MODELS) >= _MODELS_KEPT:   # a long-lived worker: the latest few only
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = model
    out = model.predict(_model_shaped(model, list(arrays)), verbose=0)
    return [out] if not isinstance(out, (list, tuple)) else list(out)


def _clone(model: Any, custom: Mapping[str, Any]) -> Any:
    return keras.models.model_from_json(model.to_json(), custom_objects=dict(custom))


def _save_weights(weights: List[Any], meta: Any = None) -> bytes:
    """Weights (and ``meta``, JSON) as NumPy's npz: no pickle to read them back."""
    buf = io.BytesIO()
    np.savez(buf, *weights, meta=np.array(json.dumps(meta)))
    return buf.getvalue()


def _load_weights(data: bytes) -> Tuple[List[Any], Any]:
    """(the weights, the meta) that :func:`_save_weights` wrote."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return ([z[f"arr_{i}"] for i in range(len(z.files) - 1)],
                json.loads(str(z["meta"])))


# -- in each rank ------------------------------------------------------------------------
def _inputs(data: Mapping[str, Any], names: List[str], shapes: Any = None) -> Any:
    arrays = [data[n] if shapes is None or shapes[i] is None else data[n].reshape(shapes[i])
              for i, n in enumerate(names)]
    return arrays[0] if len(arrays) == 1 else arrays


def _model_shaped(model: Any, arrays: List[Any]) -> Any:
    """The feature arrays, each reshaped to its model input's shape where that shape is
    known and holds as many values per row (a flat vector column into a model whose
    input is an image, as Horovod's estimator does); one array for a single input."""
    shaped = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        want = tuple(model.inputs[i].shape[1:]) if i < len(model.inputs) else None
        if want and None not in want and a.ndim >= 1 and \
                int(np.prod(want)) == int(np.prod(a.shape[1:])) and a.shape[1:] != want:
            a = a.reshape((len(a),) + want)
        shaped.append(a)
    return shaped[0] if len(shaped) == 1 else shaped


def _train(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """One rank's fit: its share of the rows, ``model.fit`` with ddl's optimizer and
    callbacks, rank 0's checkpoints; returns the history (and, on rank 0, the weights)."""
    import ddl.keras as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if spec["seed"] is not None:
        keras.utils.set_random_seed(spec["seed"] + rank)
    store, data, run_id = spec["store"], spec["data"], spec["run_id"]
    with keras.saving.custom_object_scope(spec["custom_objects"]):
        model = keras.models.model_from_json(spec["model"][0])
        optimizer = keras.optimizers.deserialize(spec["optimizer"])
    model.set_weights(_load_weights(spec["model"][1])[0])
    ckpt = store.get_checkpoint_path(run_id)
    history: Dict[str, List[float]] = {}
    first_epoch = 0
    blob = shared_checkpoint(store, ckpt)
    if blob is not None:  # resume an unfinished run after its last epoch
        weights, saved = _load_weights(blob)
        model.set_weights(weights)
        history, first_epoch = saved["history"], int(saved["epoch"]) + 1
    kwargs = {"backward_passes_per_step": spec["backward_passes_per_step"]}
    if spec["compression"] is not None:
        kwargs["compression"] = spec["compression"]
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer, **kwargs),
                  loss=spec["loss"], loss_weights=spec["loss_weights"],
                  metrics=spec["metrics"])
    cols = spec["features"] + spec["labels"] + ([spec["weight"]] if spec["weight"] else [])
    described = [data.column(c) for c in cols]
    train = read_shard(store, data.train_path, described, rank, size)
    rows = len(train[cols[0]])
    if rows < spec["batch_size"]:
        raise ValueError(f"KerasEstimator.fit: each of the {size} ranks has {rows} training "
                         f"rows, fewer than batch_size {spec['batch_size']}: lower "
                         f"batch_size or num_proc")
    fit = dict(x=_model_shaped(model, [train[c] for c in spec["features"]]),
               y=_inputs(train, spec["labels"], spec["label_shapes"]),
               batch_size=spec["batch_size"], epochs=spec["epochs"],
               initial_epoch=first_epoch, shuffle=spec["shuffle"],
               verbose=spec["verbose"] if rank == 0 else 0)
    if spec["train_steps"]:
        fit["steps_per_epoch"] = _steps("train_steps_per_epoch", spec["train_steps"], rows,
                                        spec["batch_size"])
    if spec["weight"]:
        fit["sample_weight"] = train[spec["weight"]]
    if data.val_path and data.val_rows >= size:
        val = read_shard(store, data.val_path, described, rank, size)
        fit["validation_data"] = tuple(
            [_model_shaped(model, [val[c] for c in spec["features"]]),
             _inputs(val, spec["labels"], spec["label_shapes"])]
            + ([val[spec["weight"]]] if spec["weight"] else []))
        fit["validation_batch_size"] = spec["val_batch_size"]
        if spec["val_steps"]:
            fit["validation_steps"] = _steps("validation_steps_per_epoch", spec["val_steps"],
                                             len(val[cols[0]]), spec["val_batch_size"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if rank == 0 and ckpt:
        callbacks.append(_Checkpoint(store, ckpt, history))
    result = model.fit(callbacks=callbacks + spec["callbacks"], **fit)
    for k, values in result.history.items():
        history.setdefault(k, []).extend(float(x) for x in values)
    out: Dict[str, Any] = {"history": history}
    if rank == 0:
        out["weights"] = _save_weights(model.get_weights())
    return out


def _steps(name: str, steps: int, rows: int, batch: int) -> int:
    """``steps``, if each rank's ``rows`` give that many batches of ``batch``."""
    most = -(-rows // batch)
    if steps > most:
        raise ValueError(f"KerasEstimator.fit: {name} {steps} is more than the {most} batches "
                         f"of {batch} that each rank's {rows} rows give; leave it unset to "
                         f"use them all")
    return steps


class _Checkpoint(keras.callbacks.Callback):
    """Rank 0's checkpoint after every epoch: one file (written whole) with the weights,
    the history so far and the epoch."""

    def __init__(self, store: Any, path: str, history: Dict[str, List[float]]):
        super().__init__()
        self._store, self._path = store, path
        self._history = {k: list(v) for k, v in history.items()}

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        for k, value in (logs or {}).items():
            self._history.setdefault(k, []).append(float(value))
        meta = {"epoch": epoch, "history": self._history}
        self._store.write(self._path, _save_weights(self.model.get_weights(), meta))
