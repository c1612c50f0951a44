"""Array adapters: how ddl reads a framework's array and builds a result of the same kind.

An adapter turns an input into a host NumPy view (without copying where the framework
allows) and turns a NumPy result back into the input's type, device and dtype. Adapters
are tried in order; the first whose ``supports(x)`` is true handles ``x``. Framework
adapters register themselves from their client package (``ddl.torch`` and friends), so
importing ``ddl`` never imports a framework.
"""

from __future__ import annotations

import abc
from typing import Any, List

import numpy as np

from ddl.core import dtypes as _dtypes


class ArrayAdapter(abc.ABC):
    """Converts between one framework's arrays and NumPy."""

    name = "abstract"

    @abc.abstractmethod
    def supports(self, x: Any) -> bool:
        """Whether ``x`` is an array of this adapter's framework."""

    @abc.abstractmethod
    def to_numpy(self, x: Any) -> np.ndarray:
        """A host NumPy array with ``x``'s values (a view where possible). Not modified."""

    @abc.abstractmethod
    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        """A new array of ``like``'s kind (type, device) holding ``arr``; may take ``arr``."""


class NumpyAdapter(ArrayAdapter):
    """NumPy arrays and scalars (``np.generic``)."""

    name = "numpy"

    def supports(self, x: Any) -> bool:
        return isinstance(x, (np.ndarray, np.generic))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        return arr


_ADAPTERS: List[ArrayAdapter] = [NumpyAdapter()]


def register_adapter(adapter: ArrayAdapter) -> None:
    """Add ``adapter`` ahead of the built-in NumPy adapter (idempotent by name)."""
    for existing in _ADAPTERS:
        if existing.name == adapter.name:
            return
    _ADAPTERS.insert(0, adapter)


def adapter_for(x: Any) -> ArrayAdapter:
    """The adapter for ``x``; ``TypeError`` naming the type if none fits."""
    for adapter in _ADAPTERS:
        if adapter.supports(x):
            return adapter
    raise TypeError(
        f"ddl collectives take arrays (numpy, or a framework array once its ddl client is "
        f"imported), not {type(x).__module__}.{type(x).__qualname__}")


def as_host_array(x: Any):
    """``(adapter, numpy_array)`` for ``x``; checks that the dtype is supported."""
    adapter = adapter_for(x)
    arr = adapter.to_numpy(x)
    _dtypes.to_wire(arr.dtype)  # raises TypeError naming an unsupported dtype
    return adapter, arr
