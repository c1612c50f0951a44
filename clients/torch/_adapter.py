"""torch tensors in and out of ddl's data plane.

A CPU tensor reaches the data plane as a NumPy view of its memory (no copy) when it is
contiguous; a non-contiguous one is made contiguous first. bfloat16 travels as the
ml_dtypes bfloat16 view of the same bytes. A CUDA tensor stays on its device when the
device data plane is there (CuPy): the collective reads it in place, ordered after the
work queued on the caller's current stream, and the result comes back as a tensor that
the caller's current stream may use at once (it waits for the data plane on the device,
not on the host). Without CuPy a CUDA tensor is staged through host memory (one copy
each way). Results come back on the input's device, in its dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ddl import ArrayAdapter
from ddl._client_api import BFLOAT16


class TorchAdapter(ArrayAdapter):
    """Converts ``torch.Tensor`` to and from NumPy for the core collectives."""

    name = "torch"

    def supports(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def to_numpy(self, x: Any) -> np.ndarray:
        return to_numpy(x)

    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        return from_numpy(arr, like.device)

    def memory(self, x: Any) -> str:
        kind = x.device.type
        return "" if kind == "cpu" else kind

    def to_device(self, x: Any) -> Any:
        if x.device.type != "cuda":
            return None
        from ddl._client_api import device_arrays as cuda
        t = x.detach()
        if t.is_sparse:
            raise TypeError("ddl collectives take dense tensors; call .to_dense() first")
        stream = torch.cuda.current_stream(t.device).cuda_stream
        if not t.is_contiguous():
            t = t.contiguous()   # queued on the current stream, which the call waits for
        return cuda.wrap_input(t.data_ptr(), numpy_dtype(t.dtype), tuple(t.shape),
                               t.device.index, t, stream)

    def from_device(self, result: Any, like: Any, stream: int) -> Any:
        from ddl._client_api import device_arrays as cuda
        data = cuda.hand_over(result, stream)
        to_capsule = getattr(data, "toDlpack", None)   # a capsule: no stream exchange
        t = (torch.utils.dlpack.from_dlpack(to_capsule()) if to_capsule is not None
             else torch.from_dlpack(data))
        return t.view(torch.bfloat16) if result.dtype == BFLOAT16 else t


_NUMPY_DTYPES: dict = {}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype (bfloat16: ml_dtypes')."""
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = (BFLOAT16 if dtype == torch.bfloat16 else
                                        torch.empty(0, dtype=dtype).numpy().dtype)
    return found


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host NumPy array with ``t``'s values: a view of ``t`` where torch allows it."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_sparse:
        raise TypeError("ddl collectives take dense tensors; call .to_dense() first")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def from_numpy(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` holding ``arr`` (sharing its memory on the CPU)."""
    if not arr.flags.c_contiguous:
        arr = arr.copy()  # (np.ascontiguousarray would make a 0-d array 1-d)
    if arr.dtype == BFLOAT16:
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(arr)
    return t if device.type == "cpu" else t.to(device)
