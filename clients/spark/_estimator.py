"""What the Spark estimators share: Horovod's keyword parameters with their
``getX``/``setX`` methods, the checks every ``fit`` makes before a task starts, and the
model's ``transform`` as a pandas UDF.

Cross-rank contract of a fit: every rank reads the same number of rows
(:mod:`ddl.spark._data`), so each runs the same number of steps per epoch; rank 0's
weights (equal on every rank after each step) are the fitted model's.
"""

from __future__ import annotations

import abc
import re
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pyspark.ml import Estimator, Model

from ddl.spark._data import check_columns


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Params:
    """Keyword parameters (``DEFAULTS``) with Horovod's accessors: ``setBatchSize(64)``
    (returns the object, to chain) and ``getBatchSize()`` for ``batch_size``. Keywords
    in ``ACCEPTED`` are Horovod's that mean nothing here (its data readers' tuning):
    taken and kept (with their accessors), with no effect. ``REFUSED`` ones raise
    ValueError when given. ``ALIASES``: other names Horovod uses for a parameter (its
    models' ``feature_columns``, its accessors' ``getTrainReaderNumWorker``)."""

    DEFAULTS: Mapping[str, Any] = {}
    ACCEPTED: Tuple[str, ...] = ()
    REFUSED: Mapping[str, str] = {}  # name -> what to do instead
    ALIASES: Mapping[str, str] = {"feature_columns": "feature_cols",
                                  "label_columns": "label_cols",
                                  "train_reader_num_worker": "train_reader_num_workers",
                                  "val_reader_num_worker": "val_reader_num_workers"}

    def _take(self, kwargs: Mapping[str, Any]) -> None:
        who = type(self).__name__
        kwargs = {self.ALIASES.get(k, k): v for k, v in kwargs.items()}
        unknown = sorted(set(kwargs) - set(self.DEFAULTS) - set(self.ACCEPTED)
                         - set(self.REFUSED))
        if unknown:
            raise TypeError(f"{who}: unexpected argument(s) {', '.join(unknown)}")
        for name, instead in self.REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{who}: {name} is not supported here; {instead}")
        self._values: Dict[str, Any] = dict(self.DEFAULTS)
        self._values.update((k, kwargs.get(k)) for k in self.ACCEPTED)
        self._values.update((k, v) for k, v in kwargs.items() if k in self.DEFAULTS)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if values is not None and name[:3] in ("get", "set") and len(name) > 3:
            key = _camel_to_snake(name[3:])
            key = self.ALIASES.get(key, key)
            if key in values:
                if name.startswith("get"):
                    return lambda: values[key]

                def setter(value: Any) -> "Params":
                    values[key] = value
                    return self
                return setter
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def params(self) -> Dict[str, Any]:
        """Every parameter's value now."""
        return dict(self._values)


def positive_int(who: str, name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: {name} must be an int >= 1, got {value!r}")


def column_list(who: str, name: str, value: Any, optional: bool = False) -> List[str]:
    """``value`` as a list of column names (a single name is a list of one)."""
    if value is None and optional:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(v, str) for v in value):
        raise ValueError(f"{who}: {name} must be a column name or a non-empty list of "
                         f"them, got {value!r}")
    return list(value)


def per_column(who: str, name: str, value: Any, columns: Sequence[str]) -> Optional[list]:
    """A per-column list (``input_shapes``, ``label_shapes``, ``loss_weights``...) of the
    columns' length, or None."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != len(columns):
        raise ValueError(f"{who}: {name} must be a list of {len(columns)} (one per column "
                         f"of {list(columns)}), got {value!r}")
    return list(value)


class SparkEstimator(Estimator, Params):
    """A Spark ML Estimator whose ``fit(df)`` trains on ``num_proc`` Spark tasks as one
    ddl job (``ddl.spark.run``) and returns a :class:`SparkModel`."""

    def __init__(self, **kwargs: Any):
        Estimator.__init__(self)
        self._take(kwargs)

    def _common(self, df: Any) -> Tuple[Any, List[str], List[str], str]:
        """The checks every fit makes on the driver, before any data is written: (the
        store, feature columns, label columns, the run id)."""
        who = f"{type(self).__name__}.fit"
        v = self._values
        store = v["store"]
        if store is None:
            raise ValueError(f"{who}: store is required: where the data and checkpoints "
                             f"go, a path every Spark node sees: store=Store.create(PATH)")
        features = column_list(who, "feature_cols", v["feature_cols"])
        labels = column_list(who, "label_cols", v["label_cols"])
        weight = v.get("sample_weight_col")
        check_columns(df, who, feature_cols=features, label_cols=labels,
                      sample_weight_col=[weight] if weight else [])
        positive_int(who, "num_proc", v["num_proc"], optional=True)
        backend = v.get("backend")
        if backend is not None:
            if v["num_proc"] is not None:
                raise ValueError(f"{who}: give num_proc or backend (whose num_proc is "
                                 f"used), not both")
            if not callable(getattr(backend, "run", None)):
                raise ValueError(f"{who}: backend must have run(fn, args) (a SparkBackend), "
                                 f"got {type(backend).__name__}")
        for name in ("batch_size", "epochs"):
            positive_int(who, name, v[name])
        for name in ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch"):
            positive_int(who, name, v.get(name), optional=True)
        run_id = v["run_id"] or f"ddl_{uuid.uuid4().hex[:12]}"
        return store, features, labels, run_id

    def _schedule(self) -> Dict[str, Any]:
        """The part of a rank's spec every estimator shares: batch sizes, epochs, steps
        per epoch (None: all of a rank's rows), shuffling and its seed (None if unset)."""
        v = self._values
        return {"batch_size": v["batch_size"],
                "val_batch_size": v["val_batch_size"] or v["batch_size"],
                "epochs": v["epochs"], "train_steps": v["train_steps_per_epoch"],
                "val_steps": v["validation_steps_per_epoch"], "shuffle": bool(v["shuffle"]),
                "seed": v["random_seed"]}

    def _train_on_spark(self, df: Any, fn: Callable, spec: Mapping[str, Any]) -> List[Any]:
        """``fn(spec)`` on every rank of one ddl job: through ``backend`` if given (its
        ranks' number and settings), else on ``num_proc`` Spark tasks of ``df``'s context
        (default: its parallelism). Each rank's result, in rank order."""
        backend = self._values.get("backend")
        if backend is not None:
            return backend.run(fn, args=(spec,))
        from ddl.spark.common.backend import SparkBackend
        return SparkBackend(num_proc=self._values["num_proc"],
                            spark_context=df.sparkSession.sparkContext).run(fn, args=(spec,))


class SparkModel(Model, Params):
    """A Spark ML Model made by a :class:`SparkEstimator`: ``transform(df)`` adds one
    output column per label (``output_cols``, by default ``<label>__output``) computed
    from the feature columns by the trained model, in a pandas UDF on the executors;
    ``getHistory()`` is the fit's per-epoch metrics."""

    ACCEPTED = ("_metadata",)   # Horovod's models take the DataFrame's schema too

    def __init__(self, **kwargs: Any):
        Model.__init__(self)
        self._take(kwargs)
        if self._values.get("output_cols") is None:
            self._values["output_cols"] = [f"{c}__output" for c in self._values["label_cols"]]

    @abc.abstractmethod
    def _predictor(self) -> Callable[[List[Any]], List[Any]]:
        """A picklable function: the feature arrays of a batch of rows (one NumPy array
        per feature column) -> one NumPy array per output."""

    def _transform(self, df: Any) -> Any:
        import numpy as np
        import pandas as pd
        from pyspark.ml.functions import vector_to_array
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import functions as F
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType
        who = f"{type(self).__name__}.transform"
        features = list(self._values["feature_cols"])
        outputs = list(self._values["output_cols"])
        check_columns(df, who, feature_cols=features)
        kinds = {f.name: f.dataType for f in df.schema.fields}
        inputs = [vector_to_array(F.col(c)) if isinstance(kinds[c], VectorUDT) else F.col(c)
                  for c in features]
        predict = self._predictor()
        # each output is a number per row (a double) or an array of them
        sample = df.select(*inputs).limit(1).toPandas()
        if len(sample) == 0:
            return df.select("*", *[F.lit(None).cast("double").alias(o) for o in outputs])
        shapes = [np.asarray(o).shape[1:] for o in predict(_arrays(sample))]
        if len(shapes) != len(outputs):
            raise ValueError(f"{who}: the model gives {len(shapes)} outputs and output_cols "
                             f"names {len(outputs)}: {outputs}")
        kinds_out = [DoubleType() if int(np.prod(s)) == 1 else ArrayType(DoubleType())
                     for s in shapes]
        schema = StructType([StructField(o, k) for o, k in zip(outputs, kinds_out)])
        scalar = [isinstance(k, DoubleType) for k in kinds_out]

        def predict_batch(frame):
            got = predict(_arrays(frame))
            columns = {}
            for name, value, one in zip(outputs, got, scalar):
                value = np.asarray(value, dtype=np.float64).reshape(len(frame), -1)
                columns[name] = value[:, 0] if one else list(value)
            return pd.DataFrame(columns)

        # Spark reads the UDF's kind from its annotations: a frame of the features (one
        # struct column) in, a frame of the outputs out
        predict_batch.__annotations__ = {"frame": pd.DataFrame, "return": pd.DataFrame}
        udf = F.pandas_udf(predict_batch, schema)
        packed = F.struct(*[col.alias(f"f{i}") for i, col in enumerate(inputs)])
        tmp = f"__ddl_{uuid.uuid4().hex[:8]}"
        return df.withColumn(tmp, udf(packed)).select(
            "*", *[F.col(f"{tmp}.{o}").alias(o) for o in outputs]).drop(tmp)


def _arrays(frame: Any) -> List[Any]:
    """One NumPy array per column of a pandas frame (array cells stacked into rows)."""
    import numpy as np
    out = []
    for i in range(frame.shape[1]):
        col = frame.iloc[:, i]
        if len(col) and isinstance(col.iloc[0], (list, np.ndarray)):
            out.append(np.stack([np.asarray(v) for v in col]))
        else:
            out.append(col.to_numpy())
    return out
