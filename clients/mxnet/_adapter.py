"""NDArray <-> NumPy for the ddl core: results keep the input's dtype and context."""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from ddl import ArrayAdapter


class MXNetAdapter(ArrayAdapter):
    """``mx.nd.NDArray`` (dense). ``asnumpy()`` waits for pending writes and copies."""

    name = "mxnet"

    def supports(self, x: Any) -> bool:
        return isinstance(x, mx.nd.NDArray)

    def to_numpy(self, x: Any) -> np.ndarray:
        if getattr(x, "stype", "default") != "default":
            raise TypeError(f"ddl.mxnet takes dense NDArrays, not {x.stype} ones")
        return x.asnumpy()

    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        return mx.nd.array(arr, ctx=like.context, dtype=like.dtype)

    def memory(self, x: Any) -> str:
        kind = x.context.device_type  # "cpu", "cpu_pinned", "cpu_shared", "gpu"
        return "cuda" if kind == "gpu" else ""
