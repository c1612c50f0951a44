"""Where ddl-bench's buffers live: host NumPy arrays, CuPy arrays on a rank's GPU, torch
tensors of them, and what waits for a device."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

import numpy as np

import ddl
from ddl.core.dtypes import BFLOAT16


def to_torch(array: np.ndarray, device: Any = None):
    """A torch tensor of ``array`` (a view on the CPU; bfloat16 through an int16 view),
    moved to ``device`` when one is given."""
    import torch
    if array.dtype == BFLOAT16:
        t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t if device is None else t.to(device)


def host_view(result: Any) -> np.ndarray:
    """``result`` as a host NumPy array: a torch tensor (on any device) or a CuPy array is
    copied back."""
    module = type(result).__module__
    if module.startswith("cupy"):
        return sys.modules["cupy"].asnumpy(result)
    if module.startswith("torch"):
        import torch
        t = result.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()
    return np.asarray(result)


def input_device(args: argparse.Namespace) -> Optional[int]:
    """The CUDA device this rank's inputs live on (``local_rank % device_count``), or None
    for host NumPy arrays."""
    if args.device == "cpu":
        return None
    import cupy
    return ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()


def to_cupy(array: np.ndarray, device: int):
    """A CuPy array of ``array`` on CUDA device ``device``."""
    import cupy
    with cupy.cuda.Device(device):
        return cupy.asarray(array)


def device_sync(x: Any) -> Callable[[], None]:
    """What waits for the device ``x`` is on (nothing for host arrays): a CuPy array's or
    a CUDA tensor's."""
    if type(x).__module__.startswith("cupy"):
        device = x.device
        return device.synchronize
    if getattr(x, "is_cuda", False):
        import torch
        return lambda: torch.cuda.synchronize(x.device)
    return lambda: None
