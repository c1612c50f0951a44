"""The estimators' data: on the driver, a DataFrame's columns written as Parquet into
the store (:func:`prepare`); in each rank, its equal share of those rows read back as
NumPy arrays (:func:`read_shard`).

Spark ML vectors become arrays (``vector_to_array``); every value of an array column
must have the same length (a model's input has one shape). Each rank reads only the row
groups that hold its rows, and every rank gets the same number of rows (up to
``num_proc - 1`` rows at the end are left out), so that all ranks run the same number
of steps: a rank with one step more would wait in a collective that the others never
start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

# Spark SQL type name -> the NumPy dtype a rank reads it as
_NUMPY = {"double": "float64", "float": "float32", "integer": "int32", "long": "int64",
          "short": "int16", "byte": "int8", "boolean": "bool"}


@dataclass(frozen=True)
class Column:
    """One column of a prepared dataset: its name, NumPy dtype, and the shape of one
    row's value (``()`` for a number, ``(n,)`` for an array or vector of n)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` wrote: the datasets' paths (``val_path`` None without
    validation), their row counts and columns."""

    train_path: str
    train_rows: int
    val_path: Optional[str]
    val_rows: int
    columns: Tuple[Column, ...] = field(default_factory=tuple)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


def check_columns(df: Any, who: str, **groups: Sequence[str]) -> None:
    """ValueError naming each column of ``groups`` (``feature_cols=[...]``, ...) that
    ``df`` lacks, and the columns it has."""
    have = set(df.columns)
    for group, names in groups.items():
        missing = [n for n in names if n not in have]
        if missing:
            raise ValueError(f"{who}: {group} names column(s) {missing} that the DataFrame "
                             f"does not have; it has {sorted(have)}")


def prepare(df: Any, store: Any, columns: Sequence[str],
            validation: Union[None, float, str], idx: Optional[int] = None,
            seed: int = 0) -> Prepared:
    """Write ``columns`` of ``df`` to ``store``'s training data path (dataset ``idx``)
    and, with ``validation`` (a fraction of the rows, split at random with ``seed``, or
    the name of a column whose true rows are the validation set), the validation rows
    to its validation path; overwrites what was there."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    kinds = {f.name: f.dataType for f in df.schema.fields}
    cols = [vector_to_array(F.col(c)).alias(c) if isinstance(kinds[c], VectorUDT)
            else F.col(c) for c in columns]
    if validation is None:
        train, val = df.select(*cols), None
    elif isinstance(validation, str):
        check_columns(df, "fit", validation=[validation])
        flag = F.col(validation).cast("boolean")
        train, val = df.filter(~flag).select(*cols), df.filter(flag).select(*cols)
    elif isinstance(validation, float) and 0 < validation < 1:
        train, val = df.select(*cols).randomSplit([1 - validation, validation], seed=seed)
    else:
        raise ValueError(f"fit: validation must be a fraction in (0, 1) or a column name, "
                         f"got {validation!r}")
    train_path = store.get_train_data_path(idx)
    train.write.mode("overwrite").parquet(train_path)
    described = _describe(store, train_path, columns)
    val_path, val_rows = None, 0
    if val is not None:
        val_path = store.get_val_data_path(idx)
        val.write.mode("overwrite").parquet(val_path)
        val_rows = _rows(store, val_path)
    train_rows = _rows(store, train_path)
    if train_rows == 0:
        raise ValueError("fit: the training data has no rows (after the validation split)")
    return Prepared(train_path, train_rows, val_path, val_rows, described)


def _rows(store: Any, path: str) -> int:
    import pyarrow.parquet as pq
    return sum(pq.ParquetFile(f).metadata.num_rows for f in store.parquet_files(path))


def _describe(store: Any, path: str, columns: Sequence[str]) -> Tuple[Column, ...]:
    """Each column's dtype and row shape, from the Parquet schema and the first row."""
    import pyarrow.parquet as pq
    files = [f for f in store.parquet_files(path) if pq.ParquetFile(f).metadata.num_rows]
    if not files:
        return tuple(Column(c, "float32", ()) for c in columns)
    first = pq.ParquetFile(files[0]).read_row_group(0, columns=list(columns)).slice(0, 1)
    out = []
    for name in columns:
        arrow = first.schema.field(name).type
        value = first.column(name)[0].as_py()
        if value is None:
            raise ValueError(f"fit: column {name!r} has null values (its first row's, at "
                             f"least); fill or drop them before fit")
        if hasattr(arrow, "value_type"):  # a list: an array or a vector
            out.append(Column(name, _dtype(arrow.value_type, name), (len(value),)))
        else:
            out.append(Column(name, _dtype(arrow, name), ()))
    return tuple(out)


def _dtype(arrow: Any, name: str) -> str:
    import pyarrow as pa
    if pa.types.is_floating(arrow) or pa.types.is_integer(arrow) or pa.types.is_boolean(arrow):
        return np.dtype(arrow.to_pandas_dtype()).name
    raise ValueError(f"fit: column {name!r} holds {arrow} values; the estimators take "
                     f"numbers, arrays of numbers and ML vectors")


def read_shard(store: Any, path: str, columns: Sequence[Column], rank: int,
               size: int) -> Dict[str, np.ndarray]:
    """Rank ``rank``'s share of the dataset at ``path``: the same number of rows on
    every rank (``total // size``, consecutive), each column a NumPy array of shape
    ``(rows,) + column.shape``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    files = store.parquet_files(path)
    if not files:   # the driver wrote it: a path this executor does not see
        import socket
        raise FileNotFoundError(
            f"rank {rank} (host {socket.gethostname()}) finds no Parquet files at {path!r}, "
            f"which the driver wrote: the store must be a path that the driver and every "
            f"executor see (a shared mount), not a local directory of one machine")
    groups: List[Tuple[str, int, int]] = []  # (file, row group, rows)
    for f in files:
        meta = pq.ParquetFile(f).metadata
        groups.extend((f, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups))
    each = sum(g[2] for g in groups) // size
    begin, end = rank * each, (rank + 1) * each
    tables, at = [], 0
    for f, g, rows in groups:
        if at < end and at + rows > begin:
            table = pq.ParquetFile(f).read_row_group(g, columns=[c.name for c in columns])
            tables.append(table.slice(max(begin - at, 0), min(end, at + rows) - max(begin, at)))
        at += rows
    table = pa.concat_tables(tables) if tables else None
    out = {}
    for c in columns:
        if table is None:
            out[c.name] = np.zeros((0,) + c.shape, dtype=c.dtype)
            continue
        data = table.column(c.name).combine_chunks()
        if data.null_count:
            raise ValueError(f"column {c.name!r} has {data.null_count} null value(s) among "
                             f"rank {rank}'s rows; fill or drop them before fit")
        if c.shape:
            flat = data.flatten().to_numpy(zero_copy_only=False)
            if flat.size != len(data) * c.shape[0]:
                raise ValueError(f"column {c.name!r}: its arrays are not all of length "
                                 f"{c.shape[0]} (the first row's); a model input has one "
                                 f"shape")
            out[c.name] = flat.astype(c.dtype, copy=False).reshape((len(data),) + c.shape)
        else:
            out[c.name] = data.to_numpy(zero_copy_only=False).astype(c.dtype, copy=False)
    return out


def shared_checkpoint(store: Any, path: Optional[str]) -> Optional[bytes]:
    """The checkpoint at ``path`` as rank 0 reads it (None: none there, or runs not
    saved), the same bytes on every rank: one rank decides whether a fit resumes, so
    every rank starts at the same epoch even where a shared mount shows a new file to
    some hosts before others."""
    import ddl
    blob = None
    if ddl.rank() == 0 and path and store.exists(path):
        blob = store.read(path)
    return ddl.broadcast_object(blob, root_rank=0, name="ddl.spark.checkpoint")

