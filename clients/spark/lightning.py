"""Horovod's ``horovod.spark.lightning`` on ddl: :class:`TorchEstimator` trains a PyTorch
Lightning module on a Spark DataFrame as one ddl job of ``num_proc`` Spark tasks, each
running a Lightning ``Trainer`` with :class:`ddl.torch.lightning.DDLStrategy`, and
returns a :class:`TorchModel` whose ``transform(df)`` adds the model's outputs as
columns.

::

    from ddl.spark.common.store import Store
    from ddl.spark.lightning import TorchEstimator

    class Net(pl.LightningModule):
        def training_step(self, batch, batch_idx):   # batch: {column name: tensor}
            loss = F.nll_loss(self(batch["features"]), batch["label"].long())
            self.log("train_loss", loss, on_epoch=True, sync_dist=True)
            return loss
        ...

    est = TorchEstimator(num_proc=4, store=Store.create("/shared/ddl"), model=Net(),
                         feature_cols=["features"], label_cols=["label"],
                         input_shapes=[[-1, 1, 28, 28]], batch_size=64, epochs=5,
                         validation=0.1)
    pred = est.fit(train_df).setOutputCols(["label_prob"]).transform(test_df)

How a fit runs: the feature, label and weight columns are written as Parquet into the
store; each rank reads its equal share of the rows (:mod:`ddl.spark._data`) and fits the
module with its own ``Trainer(strategy=DDLStrategy(), max_epochs=epochs, ...)`` of the
module's Lightning (``lightning.pytorch`` or ``pytorch_lightning``: the Trainer, callbacks
and logger must be of one package), so the
module's steps, hooks, ``self.log`` calls and the given ``callbacks`` run as in any
Lightning fit. Each batch is a dict from column name to tensor (floats and booleans as
float32, integers as int64), the feature columns reshaped by ``input_shapes`` and the
labels by ``label_shapes`` where given; ``transform`` calls ``model(*features)`` with the
same shapes. Every rank runs the same number of batches per epoch:
``train_steps_per_epoch`` (default: its rows // ``batch_size``; past its last row a batch
wraps around to the first) and ``validation_steps_per_epoch`` (default: all its
validation rows).

A model that is a plain ``torch.nn.Module`` (Horovod's "legacy" use) is trained with
``optimizer`` and ``loss`` as :class:`ddl.spark.torch.TorchEstimator` trains it, inside
a Lightning module that logs ``loss``, the ``metrics`` and their ``val_`` ones.

After every epoch (after its validation) rank 0 writes a Lightning checkpoint to
``store.get_checkpoint_path(run_id)``; a fit with the ``run_id`` of an unfinished run
resumes from it (``Trainer.fit(ckpt_path=...)``: weights, optimizers, epoch, callbacks'
state). ``getHistory()`` holds, per epoch, each scalar of rank 0's
``trainer.callback_metrics`` at the epoch's end (log with ``sync_dist=True`` for the
means over every rank). With a ``ModelCheckpoint`` among ``callbacks`` (its ``dirpath``
defaults to the run's directory in the store), the fitted model is its best one.

Cross-rank contract: as :mod:`ddl.torch.lightning`'s: every rank builds the same
Trainer and fits the same module; scale the learning rate by ``ddl.size()`` yourself.
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
import warnings
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch
import torch.utils.data

from ddl.torch.lightning import PerLightningPackage, lightning_modules, lightning_package
from ddl.spark._data import prepare, read_shard, shared_checkpoint
from ddl.spark._estimator import SparkEstimator, per_column
from ddl.spark.torch import TorchModel as _TorchModel
from ddl.spark.torch import loss_of, loss_spec, metric_values, to_tensors

__all__ = ["TorchEstimator", "TorchModel"]

_ACCEPTED = ("shuffle_buffer_size", "partitions_per_process", "train_reader_num_workers",
             "val_reader_num_workers", "reader_pool_type", "inmemory_cache_all",
             "mp_start_method", "loader_num_epochs", "debug_data_loader",
             "train_async_data_loader_queue_size", "val_async_data_loader_queue_size")


class TorchEstimator(SparkEstimator):
    """Horovod's Lightning ``TorchEstimator``: a Spark ML Estimator whose ``fit(df)``
    trains ``model`` (a ``LightningModule``, or a ``torch.nn.Module`` with ``optimizer``
    and ``loss``) on ``num_proc`` Spark tasks as one ddl job, and returns a
    :class:`TorchModel` (see the module doc). Its arguments, all keywords, each with
    Horovod's ``getX``/``setX``:

    ``num_proc`` or ``backend``, ``model``, ``store``, ``feature_cols``, ``label_cols``,
    ``sample_weight_col``, ``input_shapes``, ``label_shapes``, ``validation`` (a fraction
    or a column name), ``batch_size`` (32), ``val_batch_size``, ``epochs`` (1),
    ``train_steps_per_epoch``, ``validation_steps_per_epoch``, ``shuffle`` (True),
    ``random_seed`` (``lightning.seed_everything`` on every rank; the shuffles differ
    per rank), ``callbacks`` (Lightning callbacks, on every rank), ``logger`` (default: a
    ``CSVLogger`` in the run's ``logs`` directory of the store, written by rank 0),
    ``log_every_n_steps`` (50), ``profiler``, ``terminate_on_nan`` (a rank whose
    training loss is not finite raises, failing the fit), ``trainer_args`` (more
    ``Trainer`` keywords, over the estimator's), ``gradient_compression``
    (``ddl.torch.Compression``), ``use_gpu`` and ``num_gpus`` (0: the CPU; else each rank
    on the GPU of its local rank, where CUDA is available), ``run_id``, ``verbose``
    (1: rank 0 prints a line per epoch and Lightning's model summary).

    For a plain ``torch.nn.Module``: ``optimizer``, ``loss`` or ``loss_constructors``,
    ``loss_weights``, ``metrics``, as :class:`ddl.spark.torch.TorchEstimator` takes them;
    a ``LightningModule`` brings its own, and giving them too is an error.

    Horovod's data-reader knobs are accepted and change nothing (each rank reads its rows
    into memory). ``data_module``, ``train_minibatch_fn`` and the ``transformation_*``
    arguments raise ValueError."""

    DEFAULTS = dict(num_proc=None, backend=None, model=None, store=None, optimizer=None,
                    loss=None, loss_constructors=None, loss_weights=None, metrics=None,
                    feature_cols=None, label_cols=None, sample_weight_col=None,
                    input_shapes=None, label_shapes=None, validation=None, batch_size=32,
                    val_batch_size=None, epochs=1, train_steps_per_epoch=None,
                    validation_steps_per_epoch=None, shuffle=True, random_seed=None,
                    callbacks=None, logger=None, log_every_n_steps=50, profiler=None,
                    terminate_on_nan=False, trainer_args=None, gradient_compression=None,
                    use_gpu=True, num_gpus=None, run_id=None, verbose=1)
    ACCEPTED = _ACCEPTED
    REFUSED = {"data_module": "the estimator reads each rank's share of the DataFrame "
                              "itself; prepare the data in the DataFrame",
               "train_minibatch_fn": "write the step into the module's training_step",
               "transformation_fn": "transform the DataFrame before fit",
               "transformation_edit_fields": "transform the DataFrame before fit",
               "transformation_removed_fields": "transform the DataFrame before fit"}

    def _fit(self, df: Any) -> "TorchModel":
        v = self._values
        who = "TorchEstimator.fit"
        store, features, labels, run_id = self._common(df)
        model = v["model"]
        package = lightning_package(model)   # the model's Lightning: its Trainer's too
        if isinstance(model, lightning_modules(package).LightningModule):
            given = [k for k in ("optimizer", "loss", "loss_constructors", "loss_weights",
                                 "metrics") if v[k] is not None]
            if given:
                raise ValueError(f"{who}: {', '.join(given)} given with a LightningModule, "
                                 f"which brings its own (configure_optimizers, "
                                 f"training_step, self.log): leave them out")
            legacy = None
        elif isinstance(model, torch.nn.Module):
            if not isinstance(v["optimizer"], torch.optim.Optimizer):
                raise ValueError(f"{who}: a plain torch.nn.Module needs optimizer, a "
                                 f"torch.optim.Optimizer over its parameters (or make it a "
                                 f"LightningModule), got {type(v['optimizer']).__name__}")
            legacy = loss_spec(who, v, labels)
        else:
            raise ValueError(f"{who}: model must be a lightning.pytorch.LightningModule (or "
                             f"a torch.nn.Module with optimizer and loss), got "
                             f"{type(model).__name__}")
        if v["trainer_args"] is not None and not isinstance(v["trainer_args"], dict):
            raise ValueError(f"{who}: trainer_args must be a dict of Trainer keywords, got "
                             f"{v['trainer_args']!r}")
        weight = v["sample_weight_col"]
        columns = features + labels + ([weight] if weight else [])
        data = prepare(df, store, columns, v["validation"], seed=v["random_seed"] or 0)
        spec = {"model": model, "optimizer": v["optimizer"], "legacy": legacy,
                "package": package,
                "store": store, "data": data, "features": features, "labels": labels,
                "weight": weight,
                "input_shapes": per_column(who, "input_shapes", v["input_shapes"], features),
                "label_shapes": per_column(who, "label_shapes", v["label_shapes"], labels),
                **self._schedule(), "callbacks": list(v["callbacks"] or []),
                "logger": v["logger"], "log_every_n_steps": v["log_every_n_steps"],
                "profiler": v["profiler"], "terminate_on_nan": bool(v["terminate_on_nan"]),
                "trainer_args": dict(v["trainer_args"] or {}),
                "compression": v["gradient_compression"],
                "gpu": bool(v["use_gpu"]) and v["num_gpus"] != 0, "run_id": run_id,
                "verbose": v["verbose"]}
        results = self._train_on_spark(df, _train, spec)
        model, optimizer = copy.deepcopy((model, v["optimizer"]))
        state = torch.load(io.BytesIO(results[0]["state"]), map_location="cpu",
                           weights_only=True)
        model.load_state_dict(state["model"])
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        return TorchModel(model=model, optimizer=optimizer, history=results[0]["history"],
                          feature_cols=features, label_cols=labels,
                          input_shapes=spec["input_shapes"], run_id=run_id)


class TorchModel(_TorchModel):
    """What :meth:`TorchEstimator.fit` returns: ``getModel()`` (the trained module, on
    the CPU), ``getOptimizer()`` (a plain module's; None for a LightningModule),
    ``getHistory()`` (``{metric: [one value per epoch]}``), ``getRunId()``;
    ``transform(df)`` adds ``output_cols`` (``setOutputCols``)."""


# -- in each rank ------------------------------------------------------------------------
def _train(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """One rank's fit: a Lightning Trainer over its share of the rows; returns the
    history (and, on rank 0, the trained weights)."""
    import ddl.torch as hvd
    from ddl.torch.lightning import DDLStrategy
    hvd.init()   # joined already under ddl.spark.run; a Backend of one's own may not have
    rank, size = hvd.rank(), hvd.size()
    package = spec["package"]
    pl = lightning_modules(package).pl
    if spec["seed"] is not None:
        pl.seed_everything(spec["seed"], verbose=False)
    store, data, run_id = spec["store"], spec["data"], spec["run_id"]
    legacy = spec["legacy"]
    module = _Legacy.for_package(package)(spec) if legacy is not None else spec["model"]
    cols = spec["features"] + spec["labels"] + ([spec["weight"]] if spec["weight"] else [])
    described = [data.column(c) for c in cols]
    train = read_shard(store, data.train_path, described, rank, size)
    rows = len(train[cols[0]])
    steps = spec["train_steps"] or rows // spec["batch_size"]
    if steps < 1:
        raise ValueError(f"TorchEstimator.fit: each of the {size} ranks has {rows} training "
                         f"rows, fewer than batch_size {spec['batch_size']}: lower "
                         f"batch_size or num_proc")
    seed = 0 if spec["seed"] is None else spec["seed"]
    loaders = [_loader(spec, train, steps, spec["batch_size"], spec["shuffle"], [seed, rank])]
    if data.val_path and data.val_rows >= size:
        val = read_shard(store, data.val_path, described, rank, size)
        size_v = spec["val_batch_size"]
        val_steps = spec["val_steps"] or -(-len(val[cols[0]]) // size_v)
        loaders.append(_loader(spec, val, val_steps, size_v, False, None))
    elif data.val_path and rank == 0:
        print(f"TorchEstimator.fit: the validation set has {data.val_rows} rows, fewer than "
              f"num_proc {size}: no validation", flush=True)
    ckpt = store.get_checkpoint_path(run_id)
    callbacks = list(spec["callbacks"])
    for cb in callbacks:   # a user's checkpoints go to the run's directory by default
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.dirpath is None and ckpt:
            cb.dirpath = os.path.dirname(ckpt)
    epoch_end = _EpochEnd.for_package(package)(ckpt, spec["epochs"], spec["verbose"],
                                               spec["terminate_on_nan"])
    logger = spec["logger"]
    if logger is None:
        logs = store.get_logs_path(run_id)
        logger = pl.loggers.CSVLogger(logs, name="", version="") if logs else False
    strategy = DDLStrategy.for_package(package)
    kwargs = dict(strategy=strategy(compression=spec["compression"] or hvd.Compression.none),
                  accelerator="gpu" if spec["gpu"] and torch.cuda.is_available() else "cpu",
                  devices=1, max_epochs=spec["epochs"], callbacks=callbacks + [epoch_end],
                  logger=logger, log_every_n_steps=spec["log_every_n_steps"],
                  profiler=spec["profiler"], num_sanity_val_steps=0,
                  use_distributed_sampler=False, enable_progress_bar=False,
                  enable_model_summary=rank == 0 and spec["verbose"] >= 1)
    kwargs.update(spec["trainer_args"])
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    trainer = pl.Trainer(**kwargs)
    blob = shared_checkpoint(store, ckpt)
    with tempfile.TemporaryDirectory(prefix="ddl-lightning-") as tmp:
        resume = None
        if blob is not None:   # every rank resumes from the bytes rank 0 read
            resume = os.path.join(tmp, "resume.ckpt")
            with open(resume, "wb") as f:
                f.write(blob)
        trainer.fit(module, *loaders, ckpt_path=resume)
    out: Dict[str, Any] = {"history": epoch_end.history}
    if rank == 0:
        best = next((cb.best_model_path for cb in trainer.checkpoint_callbacks
                     if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.best_model_path),
                    None)
        if best:
            weights = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
            module.load_state_dict(weights)
        inner = module.model if legacy is not None else module
        buf = io.BytesIO()
        torch.save({"model": {k: t.detach().cpu() for k, t in inner.state_dict().items()},
                    "optimizer": spec["optimizer"].state_dict() if legacy is not None
                    else None}, buf)
        out["state"] = buf.getvalue()
    return out


def _loader(spec: Mapping[str, Any], columns: Mapping[str, Any], steps: int,
            batch_size: int, shuffle: bool, seed: Optional[List[int]]):
    """A DataLoader of exactly ``steps`` batches (dicts of tensors) of ``columns``."""
    return torch.utils.data.DataLoader(_Rows(spec, columns), batch_size=None,
                                       sampler=_Batches(len(next(iter(columns.values()))),
                                                        steps, batch_size, shuffle, seed))


class _Rows:
    """A map-style dataset whose key is an array of row numbers: the batch of those rows,
    ``{column: tensor}``, shaped by ``input_shapes`` and ``label_shapes``."""

    def __init__(self, spec: Mapping[str, Any], columns: Mapping[str, Any]):
        self.columns = columns
        self.shapes: Dict[str, Any] = {}
        for names, shapes in ((spec["features"], spec["input_shapes"]),
                              (spec["labels"], spec["label_shapes"])):
            self.shapes.update(zip(names, shapes or []))

    def __getitem__(self, rows: Any) -> Dict[str, Any]:
        return {name: to_tensors([array[rows]], [self.shapes.get(name)])[0]
                for name, array in self.columns.items()}


class _Batches:
    """``steps`` arrays of row numbers of ``batch_size`` each, wrapping around to the
    first row past the last; shuffled anew each epoch with ``seed``. With no ``seed``
    (validation), in order, and a pass's last batch may be shorter."""

    def __init__(self, rows: int, steps: int, batch_size: int, shuffle: bool,
                 seed: Optional[List[int]]):
        self.rows, self.steps, self.batch_size, self.shuffle = rows, steps, batch_size, shuffle
        self.rng = np.random.default_rng(seed) if seed is not None else None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        order = self.rng.permutation(self.rows) if self.shuffle else np.arange(self.rows)
        b = self.batch_size
        for step in range(self.steps):
            stop = (step + 1) * b
            if self.rng is None and step * b < self.rows:
                stop = min(stop, self.rows)
            yield np.take(order, np.arange(step * b, stop), mode="wrap")


class _EpochEnd(metaclass=PerLightningPackage):
    """After each epoch (and its validation, and the module's ``on_train_epoch_end``):
    the history, rank 0's line, the run's checkpoint. A ``Checkpoint``, so that Lightning
    runs it after the epoch's metrics are logged; its history is saved in the
    checkpoint. With ``nan``, a training loss that is not finite raises."""

    _lightning_base = "Checkpoint"

    def __init__(self, path: Optional[str], epochs: int, verbose: int, nan: bool):
        self.path, self.epochs, self.verbose, self.nan = path, epochs, verbose, nan
        self.history: Dict[str, List[float]] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.nan and isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            raise ValueError(f"terminate_on_nan: rank {trainer.global_rank}'s training loss "
                             f"is {float(loss)} at epoch {trainer.current_epoch}, batch "
                             f"{batch_idx}")

    def on_train_epoch_end(self, trainer, module) -> None:
        for name, value in sorted(trainer.callback_metrics.items()):
            if getattr(value, "numel", lambda: 1)() == 1:
                self.history.setdefault(name, []).append(float(value))
        if trainer.global_rank == 0 and self.verbose:
            shown = ", ".join(f"{k} {v[-1]:.6g}" for k, v in self.history.items())
            print(f"epoch {trainer.current_epoch + 1}/{self.epochs}: {shown}", flush=True)
        if self.path:
            trainer.save_checkpoint(self.path)   # rank 0 writes; then a barrier

    def state_dict(self) -> Dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}


class _Legacy(metaclass=PerLightningPackage):
    """A plain module with its optimizer and losses, as a Lightning module: its steps
    are :class:`ddl.spark.torch.TorchEstimator`'s, logging ``loss`` and the metrics
    (``val_`` ones in validation), averaged over the ranks."""

    _lightning_base = "LightningModule"

    def __init__(self, spec: Mapping[str, Any]):
        super().__init__()
        self.model = spec["model"]
        self._ddl_spec, self._ddl_optimizer = spec, spec["optimizer"]

    def forward(self, *inputs):
        return self.model(*inputs)

    def configure_optimizers(self):
        return self._ddl_optimizer

    def _step(self, batch: Mapping[str, Any], prefix: str):
        spec = self._ddl_spec
        legacy = spec["legacy"]
        loss, outputs, labels = loss_of(
            legacy, self.model, [batch[c] for c in spec["features"]],
            [batch[c] for c in spec["labels"]],
            batch[spec["weight"]] if spec["weight"] else None)
        rows = len(batch[spec["features"][0]])
        for name, value in [("loss", loss)] + list(metric_values(legacy, outputs,
                                                                 labels).items()):
            self.log(prefix + name, value, on_step=False, on_epoch=True, sync_dist=True,
                     batch_size=rows)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val_")
