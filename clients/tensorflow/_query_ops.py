"""Horovod's topology queries as TensorFlow ops (``size_op``, ``rank_op``, ...): int32
scalars read when the op runs, not when it is built (a graph built before
:func:`ddl.init`, or an elastic job whose size changes). Local to each rank: no
collective."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

import ddl
from ddl import ProcessSet, global_process_set
from ddl._client_api import process_set_by_id
from ddl.tensorflow._ops import _refuse_xla


def _query_op(what: str, value, name: Optional[str]) -> tf.Tensor:
    """An int32 scalar op whose value is read when it runs, not when it is built."""
    _refuse_xla(name or f"ddl_{what}")
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True,
                            name=name or f"ddl_{what}")
    out.set_shape([])
    return out


def _process_set(process_set) -> ProcessSet:
    """A ProcessSet, or Horovod's id of one this rank knows (0: the global set)."""
    if isinstance(process_set, ProcessSet):
        return process_set
    return process_set_by_id(process_set)


def size_op(process_set=global_process_set, name: Optional[str] = None,
            process_set_id: Optional[int] = None) -> tf.Tensor:
    """The number of members of ``process_set`` (default: every rank), as an int32 op read
    when it runs: in a graph built before :func:`init`, or in an elastic job whose size
    changes. ``process_set`` is a ProcessSet, or Horovod's id of one this rank knows (0:
    the global set), also as Horovod's keyword ``process_set_id``."""
    ps = _process_set(process_set if process_set_id is None else process_set_id)
    return _query_op("size", ps.size, name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """:func:`ddl.local_size` as an int32 op read when it runs."""
    return _query_op("local_size", ddl.local_size, name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """:func:`ddl.rank` as an int32 op read when it runs."""
    return _query_op("rank", ddl.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """:func:`ddl.local_rank` as an int32 op read when it runs."""
    return _query_op("local_rank", ddl.local_rank, name)


def process_set_included_op(process_set=global_process_set, name: Optional[str] = None,
                            process_set_id: Optional[int] = None) -> tf.Tensor:
    """1 if this rank is a member of ``process_set``, else 0, as an int32 op read when it
    runs (``process_set``: a ProcessSet, or Horovod's id of one this rank knows, also as
    Horovod's keyword ``process_set_id``)."""
    ps = _process_set(process_set if process_set_id is None else process_set_id)
    return _query_op("process_set_included", ps.included, name)
