"""Array adapters: how ddl reads a framework's array and builds a result of the same kind.

An adapter turns an input into a host NumPy view (without copying where the framework
allows) and turns a NumPy result back into the input's type, device and dtype. Adapters
are tried in order; the first whose ``supports(x)`` is true handles ``x``. Framework
adapters register themselves from their client package (``ddl.torch`` and friends), so
importing ``ddl`` never imports a framework; CuPy's is built in and looks for CuPy only
among the modules the program has already imported.

Each adapter also says where an input's bytes live (:meth:`ArrayAdapter.memory`): host
memory, or a device kind such as ``"cuda"``. Every member of a collective must pass the
same kind (the leader checks it, naming both ranks). A CUDA array stays on its device
when the adapter can view it (:meth:`ArrayAdapter.to_device`) and CuPy is there (the
device data plane, :mod:`ddl.dataplane.device`); otherwise it is staged through host
memory, one copy each way.
"""

from __future__ import annotations

import abc
import logging
import sys
from typing import Any, List, Set

import numpy as np


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

    def memory(self, x: Any) -> str:
        """Where ``x``'s bytes live: ``""`` for host memory (the default), else the device
        kind (``"cuda"``, or the framework's name for another accelerator). It is what
        ``Request.memory`` carries, so it must not depend on the device's index."""
        return ""

    def to_device(self, x: Any) -> Any:
        """For a CUDA ``x``: a :class:`ddl.dataplane.device.cuda.DeviceArray` viewing it
        (no copy; a non-contiguous ``x`` is made contiguous first), ready once the
        caller's current stream reaches this call; or None, and ``x`` is staged through
        host memory. Called only when the device data plane is available."""
        return None

    def from_device(self, result: Any, like: Any, stream: int) -> Any:
        """A new array of ``like``'s kind holding the device ``result`` (a
        ``DeviceArray``; may take its memory), safe to use on the caller's stream
        ``stream`` (:func:`ddl.dataplane.device.cuda.hand_over`)."""
        raise NotImplementedError(f"{self.name} arrays do not come back from the device")


class NumpyAdapter(ArrayAdapter):
    """NumPy arrays and scalars (``np.generic``)."""

    name = "numpy"

    def supports(self, x: Any) -> bool:
        return isinstance(x, (np.ndarray, np.generic))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        return arr


class CupyAdapter(ArrayAdapter):
    """CuPy arrays (always device memory), once the program has imported CuPy itself."""

    name = "cupy"

    def supports(self, x: Any) -> bool:
        cupy = sys.modules.get("cupy")
        return cupy is not None and isinstance(x, cupy.ndarray)

    def to_numpy(self, x: Any) -> np.ndarray:
        return sys.modules["cupy"].asnumpy(x)  # on the current stream; waits for it

    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        cupy = sys.modules["cupy"]
        with like.device:
            return cupy.asarray(arr)

    def memory(self, x: Any) -> str:
        return "cuda"

    def to_device(self, x: Any) -> Any:
        from ddl.runtime import device_arrays as cuda
        cp = sys.modules["cupy"]
        with x.device:
            x = cp.ascontiguousarray(x)   # on the current stream, which the call waits for
            caller = cp.cuda.get_current_stream()
        # (the caller's stream object lives as long as the input: the result's release
        # records an event on it)
        return cuda.wrap_input(x.data.ptr, x.dtype, x.shape, x.device.id, (x, caller),
                               caller.ptr)

    def from_device(self, result: Any, like: Any, stream: int) -> Any:
        from ddl.runtime import device_arrays as cuda
        data = cuda.hand_over(result, stream)
        return data.view(result.dtype) if data.dtype != result.dtype else data


_ADAPTERS: List[ArrayAdapter] = [NumpyAdapter(), CupyAdapter()]


def register_adapter(adapter: ArrayAdapter) -> None:
    """Add ``adapter`` ahead of the built-in NumPy and CuPy adapters (idempotent by name)."""
    for existing in _ADAPTERS:
        if existing.name == adapter.name:
            return
    _ADAPTERS.insert(0, adapter)


_STAGED: Set[str] = set()


def device_plane() -> bool:
    """Whether CUDA arrays may stay on their device (CuPy is there and sees a GPU)."""
    from ddl.runtime import device_arrays as cuda
    return cuda.available()


def note_staged(memory: str) -> None:
    """Say once per process and memory kind that such arrays are staged through host
    memory (nothing for host memory)."""
    if memory and memory not in _STAGED:
        _STAGED.add(memory)
        logging.getLogger("ddl").warning(
            "ddl: %s arrays are staged through host memory (one copy from the device and "
            "one back per call): the device data plane needs CuPy and a GPU (pip install "
            "'ddl-train[cuda]' for CUDA 12, 'ddl-train[cuda13]' for CUDA 13; docs/gpu.md)",
            memory)


def adapter_for(x: Any) -> ArrayAdapter:
    """The adapter for ``x``; ``TypeError`` naming the type if none fits."""
    for adapter in _ADAPTERS:
        if adapter.supports(x):
            return adapter
    raise TypeError(
        f"ddl collectives take arrays (numpy, or a framework array once its ddl client is "
        f"imported), not {type(x).__module__}.{type(x).__qualname__}")
