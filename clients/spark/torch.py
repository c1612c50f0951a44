"""Horovod's ``horovod.spark.torch`` on ddl: :class:`TorchEstimator` trains a PyTorch
model on a Spark DataFrame as one ddl job of ``num_proc`` Spark tasks, and returns a
:class:`TorchModel` whose ``transform(df)`` adds the model's outputs as columns.

::

    from ddl.spark.common.store import Store
    from ddl.spark.torch import TorchEstimator
    est = TorchEstimator(num_proc=4, store=Store.create("/shared/ddl"), model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss=torch.nn.MSELoss(), feature_cols=["features"],
                         label_cols=["y"], batch_size=32, epochs=10, validation=0.1)
    fitted = est.fit(train_df)          # a TorchModel
    pred = fitted.transform(test_df)    # test_df with a "y__output" column

How a fit runs: the feature, label and weight columns are written as Parquet into the
store (ML vectors as arrays); each rank reads its equal share of the rows
(:mod:`ddl.spark._data`), starts from rank 0's weights and optimizer state, and trains
with ``ddl.torch.DistributedOptimizer``: each step's gradients averaged over the ranks.
Each feature column is one input of the model (``model(*inputs)``, reshaped with
``input_shapes``); each label column is compared with the matching output by ``loss``
(one loss, or one per label, weighted by ``loss_weights``). Floating columns become
float32 tensors, integer ones int64 (for class labels), booleans float32. A label with
as many elements as its output takes the output's shape, unless ``label_shapes`` says
otherwise. With ``sample_weight_col``, the loss gives one value per row (called with
``reduction="none"`` when it takes that keyword, as Horovod's; a loss module is made
so): the step's loss is the mean of each row's loss times its weight, as Horovod's.

After every epoch rank 0 writes a checkpoint (the model's and optimizer's state, the
history) to ``store.get_checkpoint_path(run_id)``; a fit with the ``run_id`` of an
unfinished run resumes after its last checkpointed epoch. ``getHistory()`` holds, per
epoch, the loss and each metric averaged over every rank's rows (and ``val_`` ones on
the validation rows).
"""

from __future__ import annotations

import copy
import io
from typing import Any, Callable, Dict, List, Mapping, Optional

from ddl.spark._data import prepare, read_shard, shared_checkpoint
from ddl.spark._estimator import SparkEstimator, SparkModel, per_column

__all__ = ["TorchEstimator", "TorchModel"]

_READER_KNOBS = ("shuffle_buffer_size", "partitions_per_process",
                 "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type",
                 "inmemory_cache_all", "mp_start_method")


class TorchEstimator(SparkEstimator):
    """Horovod's ``TorchEstimator``: a Spark ML Estimator whose ``fit(df)`` trains ``model``
    on ``num_proc`` Spark tasks as one ddl job and returns a :class:`TorchModel` (see the
    module doc). Its arguments, all keywords, each with Horovod's ``getX``/``setX``:

    ``num_proc`` (default: Spark's default parallelism), ``model``, ``optimizer`` (an
    instance over the model's parameters), ``loss`` (a callable or one per label) or
    ``loss_constructors`` (functions that make them), ``loss_weights``, ``metrics``
    (callables ``metric(output, label)`` giving a number, reported per epoch under their
    ``__name__``), ``store``, ``feature_cols``, ``label_cols``, ``sample_weight_col``,
    ``input_shapes``, ``label_shapes``, ``validation`` (a fraction or a column name),
    ``batch_size`` (32), ``val_batch_size`` (``batch_size``), ``epochs`` (1),
    ``train_steps_per_epoch``/``validation_steps_per_epoch`` (default: all of each
    rank's rows), ``shuffle`` (True), ``random_seed``, ``gradient_compression``
    (``ddl.torch.Compression``), ``backward_passes_per_step``, ``use_gpu`` (each rank
    on the GPU of its local rank, where there is one), ``run_id``, ``verbose`` (1:
    rank 0 prints a line per epoch).

    Instead of ``num_proc``, ``backend``: a :class:`ddl.spark.common.backend.SparkBackend`
    (its ``num_proc``, environment and output streams). Horovod's data-reader knobs
    (``shuffle_buffer_size``, ``partitions_per_process``, ``*_reader_num_workers``,
    ``reader_pool_type``, ``inmemory_cache_all``, ``mp_start_method``) are accepted and
    change nothing: each rank reads its rows into memory. ``train_minibatch_fn``,
    ``transformation_fn`` and ``callbacks`` raise ValueError."""

    DEFAULTS = dict(num_proc=None, backend=None, model=None, optimizer=None, loss=None,
                    loss_constructors=None, loss_weights=None, metrics=None, store=None,
                    feature_cols=None, label_cols=None, sample_weight_col=None,
                    input_shapes=None, label_shapes=None, validation=None, batch_size=32,
                    val_batch_size=None, epochs=1, train_steps_per_epoch=None,
                    validation_steps_per_epoch=None, shuffle=True, random_seed=None,
                    gradient_compression=None, backward_passes_per_step=1, use_gpu=True,
                    run_id=None, verbose=1)
    ACCEPTED = _READER_KNOBS
    REFUSED = {"train_minibatch_fn": "write the step into the model's forward and the loss",
               "transformation_fn": "transform the DataFrame before fit",
               "callbacks": "read getHistory() and the checkpoints in the store"}

    def _fit(self, df: Any) -> "TorchModel":
        import torch
        v = self._values
        who = "TorchEstimator.fit"
        store, features, labels, run_id = self._common(df)
        if not isinstance(v["model"], torch.nn.Module):
            raise ValueError(f"{who}: model must be a torch.nn.Module, got "
                             f"{type(v['model']).__name__}")
        if not isinstance(v["optimizer"], torch.optim.Optimizer):
            raise ValueError(f"{who}: optimizer must be a torch.optim.Optimizer over the "
                             f"model's parameters, got {type(v['optimizer']).__name__}")
        losses = loss_spec(who, v, labels)
        weight = v["sample_weight_col"]
        columns = features + labels + ([weight] if weight else [])
        data = prepare(df, store, columns, v["validation"], seed=v["random_seed"] or 0)
        spec = {**losses, "model": v["model"], "optimizer": v["optimizer"], "store": store,
                "data": data, "features": features, "labels": labels, "weight": weight,
                "input_shapes": per_column(who, "input_shapes", v["input_shapes"], features),
                **self._schedule(), "compression": v["gradient_compression"],
                "backward_passes_per_step": v["backward_passes_per_step"],
                "use_gpu": bool(v["use_gpu"]), "run_id": run_id, "verbose": v["verbose"]}
        results = self._train_on_spark(df, _train, spec)
        model, optimizer = copy.deepcopy((v["model"], v["optimizer"]))
        state = torch.load(io.BytesIO(results[0]["state"]), map_location="cpu",
                           weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return TorchModel(model=model, optimizer=optimizer, history=results[0]["history"],
                          feature_cols=features, label_cols=labels,
                          input_shapes=spec["input_shapes"], run_id=run_id)


class TorchModel(SparkModel):
    """What :meth:`TorchEstimator.fit` returns (Horovod's ``TorchModel``): ``getModel()``
    (the trained ``torch.nn.Module``, on the CPU), ``getOptimizer()``, ``getHistory()``
    (``{"loss": [...], "val_loss": [...], ...}``, one value per epoch), ``getRunId()``;
    ``transform(df)`` adds ``output_cols`` (``setOutputCols``)."""

    DEFAULTS = dict(model=None, optimizer=None, history=None, feature_cols=None,
                    label_cols=None, output_cols=None, input_shapes=None, run_id=None)

    def _predictor(self) -> Callable[[List[Any]], List[Any]]:
        model = self._values["model"]
        shapes = self._values["input_shapes"]
        return lambda arrays: _predict(model, shapes, arrays)


def _predict(model: Any, shapes: Optional[list], arrays: List[Any]) -> List[Any]:
    import torch
    model.eval()
    with torch.no_grad():
        out = model(*to_tensors(arrays, shapes))
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return [o.detach().cpu().numpy() for o in outs]


def loss_spec(who: str, v: Mapping[str, Any], labels: List[str]) -> Dict[str, Any]:
    """What :func:`loss_of` and :func:`metric_values` read of an estimator's parameters
    ``v`` (``loss`` or ``loss_constructors``, ``loss_weights``, ``metrics``,
    ``label_shapes``), checked against the label columns."""
    return {"who": who, "losses": _losses(who, v["loss"], v["loss_constructors"], labels),
            "loss_weights": per_column(who, "loss_weights", v["loss_weights"], labels),
            "label_shapes": per_column(who, "label_shapes", v["label_shapes"], labels),
            "metrics": list(v["metrics"] or [])}


def _losses(who: str, loss: Any, constructors: Any, labels: List[str]) -> List[Callable]:
    if constructors is not None:
        loss = [make() for make in (constructors if isinstance(constructors, (list, tuple))
                                    else [constructors])]
    if loss is None:
        raise ValueError(f"{who}: loss (or loss_constructors) is required")
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(labels)
    if len(losses) != len(labels) or not all(callable(f) for f in losses):
        raise ValueError(f"{who}: loss must be a callable or a list of {len(labels)} (one "
                         f"per label column of {labels}), got {loss!r}")
    return losses


def to_tensors(arrays: List[Any], shapes: Optional[list], device: Any = None) -> List[Any]:
    """Model inputs (or labels) from NumPy arrays: floats and booleans as float32,
    integers as int64, each reshaped with its entry of ``shapes`` if given: a shape of
    one row, without the batch's -1 (Horovod's models reshape row by row), gets the
    batch's rows in front."""
    import numpy as np
    import torch
    out = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        kind = np.int64 if np.issubdtype(a.dtype, np.integer) else np.float32
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=kind))
        if shapes is not None and shapes[i] is not None:
            shape = list(shapes[i])
            per_row = int(np.prod(shape))
            if -1 not in shape and per_row != t.numel() and per_row * len(a) == t.numel():
                shape = [len(a)] + shape
            t = t.reshape(shape)
        out.append(t if device is None else t.to(device))
    return out


# -- in each rank ------------------------------------------------------------------------
def _train(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """One rank's fit: its share of the rows, the epochs, rank 0's checkpoints; returns
    the history (and, on rank 0, the trained state)."""
    import numpy as np
    import torch
    import ddl.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, optimizer = spec["model"], spec["optimizer"]
    device = torch.device("cpu")
    if spec["use_gpu"] and torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        model.to(device)
    store, data, run_id = spec["store"], spec["data"], spec["run_id"]
    history: Dict[str, List[float]] = {}
    first_epoch = 0
    ckpt = store.get_checkpoint_path(run_id)
    blob = shared_checkpoint(store, ckpt)
    if blob is not None:  # resume an unfinished run after its last epoch
        saved = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        history = {k: list(v) for k, v in saved["history"].items()}
        first_epoch = int(saved["epoch"]) + 1
    kwargs = {"named_parameters": model.named_parameters(),
              "backward_passes_per_step": spec["backward_passes_per_step"]}
    if spec["compression"] is not None:
        kwargs["compression"] = spec["compression"]
    opt = hvd.DistributedOptimizer(optimizer, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    cols = spec["features"] + spec["labels"] + ([spec["weight"]] if spec["weight"] else [])
    described = [data.column(c) for c in cols]
    train = read_shard(store, data.train_path, described, rank, size)
    val = None
    if data.val_path and data.val_rows >= size:
        val = read_shard(store, data.val_path, described, rank, size)
    elif data.val_path and rank == 0:
        print(f"TorchEstimator.fit: the validation set has {data.val_rows} rows, fewer than "
              f"num_proc {size}: no validation", flush=True)
    rows = len(train[cols[0]])
    passes = spec["backward_passes_per_step"]   # batches whose gradients make one step
    steps = spec["train_steps"] or rows // spec["batch_size"]
    steps -= steps % passes
    if steps < 1:
        raise ValueError(f"TorchEstimator.fit: each of the {size} ranks has {rows} training "
                         f"rows, fewer than batch_size {spec['batch_size']} x "
                         f"backward_passes_per_step {passes}: lower batch_size or num_proc")
    rng = np.random.default_rng([spec["seed"] or 0, rank])
    for epoch in range(first_epoch, spec["epochs"]):
        model.train()
        order = rng.permutation(rows) if spec["shuffle"] else np.arange(rows)
        sums = _Sums()
        for step in range(steps):  # past the last row, batches wrap around to the first
            b = spec["batch_size"]
            batch = np.take(order, np.arange(step * b, (step + 1) * b), mode="wrap")
            if step % passes == 0:
                opt.zero_grad()
            loss, outputs, labels = _loss(spec, model, train, batch, device)
            loss.backward()
            if (step + 1) % passes == 0:
                opt.step()
            sums.add(spec, loss, outputs, labels, len(batch))
        _record(history, "", sums.mean(hvd, "train"))
        if val is not None:
            _record(history, "val_", _evaluate(spec, model, val, device).mean(hvd, "val"))
        if rank == 0:
            if ckpt:
                store.write(ckpt, _state(model, optimizer, history, epoch))
            if spec["verbose"]:
                shown = ", ".join(f"{k} {v[-1]:.6g}" for k, v in history.items())
                print(f"epoch {epoch + 1}/{spec['epochs']}: {shown}", flush=True)
    out: Dict[str, Any] = {"history": history}
    if rank == 0:
        out["state"] = _state(model, optimizer, history, spec["epochs"] - 1)
    return out


def _state(model: Any, optimizer: Any, history: Dict[str, List[float]], epoch: int) -> bytes:
    import torch
    buf = io.BytesIO()
    torch.save({"model": {k: t.detach().cpu() for k, t in model.state_dict().items()},
                "optimizer": optimizer.state_dict(), "history": history, "epoch": epoch}, buf)
    return buf.getvalue()


def _loss(spec: Mapping[str, Any], model: Any, data: Mapping[str, Any], rows: Any,
          device: Any):
    """(the weighted loss of ``rows``, the outputs, the labels)."""
    inputs = to_tensors([data[c][rows] for c in spec["features"]], spec["input_shapes"],
                        device)
    labels = to_tensors([data[c][rows] for c in spec["labels"]], spec["label_shapes"],
                        device)
    return loss_of(spec, model, inputs, labels,
                   data[spec["weight"]][rows] if spec["weight"] else None)


def _takes_reduction(loss: Any) -> bool:
    """Whether ``loss`` is a function with a ``reduction`` keyword (``F.mse_loss``; a loss
    module's ``forward`` has none: its reduction is set when it is made)."""
    import inspect
    try:
        return "reduction" in inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return False


def loss_of(spec: Mapping[str, Any], model: Any, inputs: List[Any], labels: List[Any],
            sample_weights: Any = None):
    """(the weighted loss of one batch, the outputs, the labels): ``model(*inputs)``
    against each label with its loss (``spec["losses"]``, ``spec["loss_weights"]``); a
    label with as many elements as its output takes the output's shape unless
    ``spec["label_shapes"]`` says otherwise. With ``sample_weights`` (one per row), each
    loss gives one value per row (called with ``reduction='none'`` when it takes that
    keyword, as Horovod calls it; else made so by the user), and the batch's loss is the
    mean of the rows' losses times their weights, as Horovod's (not divided by the
    weights' sum: two rows of one weight count the same in any batch)."""
    import torch
    out = model(*inputs)
    outputs = list(out) if isinstance(out, (list, tuple)) else [out]
    labels = [lab.reshape(o.shape) if spec["label_shapes"] is None
              and lab.numel() == o.numel() and lab.dtype.is_floating_point else lab
              for lab, o in zip(labels, outputs)]
    weights = spec["loss_weights"] or [1.0] * len(labels)
    total = 0.0
    for f, o, lab, w in zip(spec["losses"], outputs, labels, weights):
        if sample_weights is None:
            value = f(o, lab)
        else:
            value = f(o, lab, reduction="none") if _takes_reduction(f) else f(o, lab)
            if value.dim() == 0:
                raise ValueError(f"{spec['who']}: with sample_weight_col the loss must "
                                 f"give one value per row: make it with reduction='none'")
            sw = torch.as_tensor(sample_weights, dtype=value.dtype, device=value.device)
            value = (value.reshape(len(sw), -1).mean(dim=1) * sw).mean()
        total = total + w * value
    return total, outputs, labels


def metric_values(spec: Mapping[str, Any], outputs: List[Any],
                  labels: List[Any]) -> Dict[str, float]:
    """Each of ``spec["metrics"]`` on one batch (summed over the outputs), by name."""
    import torch
    values = {}
    with torch.no_grad():
        for i, metric in enumerate(spec["metrics"]):
            name = getattr(metric, "__name__", f"metric{i}")
            values[name] = sum(float(metric(o.detach(), lab)) for o, lab in zip(outputs, labels))
    return values


class _Sums:
    """Per-epoch sums of the loss and metrics (weighted by batch rows) on one rank."""

    def __init__(self):
        self.values: Dict[str, float] = {}
        self.rows = 0

    def add(self, spec: Mapping[str, Any], loss: Any, outputs: List[Any], labels: List[Any],
            rows: int) -> None:
        self.rows += rows
        self.values["loss"] = self.values.get("loss", 0.0) + float(loss.detach()) * rows
        for name, value in metric_values(spec, outputs, labels).items():
            self.values[name] = self.values.get(name, 0.0) + value * rows

    def mean(self, hvd: Any, name: str) -> Dict[str, float]:
        """The means over every rank's rows (one allreduce)."""
        import torch
        keys = sorted(self.values)
        total = hvd.allreduce(torch.tensor([self.values[k] for k in keys] + [float(self.rows)],
                                           dtype=torch.float64),
                              op=hvd.Sum, name=f"ddl.spark.{name}_metrics")
        rows = float(total[-1]) or 1.0
        return {k: float(total[i]) / rows for i, k in enumerate(keys)}


def _evaluate(spec: Mapping[str, Any], model: Any, data: Mapping[str, Any],
              device: Any) -> _Sums:
    import numpy as np
    import torch
    model.eval()
    sums = _Sums()
    rows = len(data[spec["features"][0]])
    size = spec["val_batch_size"]
    steps = spec["val_steps"] or -(-rows // size)
    with torch.no_grad():
        for step in range(steps):
            batch = np.arange(step * size, min((step + 1) * size, rows))
            if len(batch) == 0:
                break
            loss, outputs, labels = _loss(spec, model, data, batch, device)
            sums.add(spec, loss, outputs, labels, len(batch))
    return sums


def _record(history: Dict[str, List[float]], prefix: str, values: Mapping[str, float]) -> None:
    for k, v in values.items():
        history.setdefault(prefix + k, []).append(v)
