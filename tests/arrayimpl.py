"""The array libraries the collective contract runs over (in the spirit of mpi4py's
``test/arrayimpl.py``), one :class:`ArrayImpl` each, listed in :data:`IMPLS`.

An entry knows how to build one of its arrays from a NumPy array of a dtype it supports,
how to read one back, which dtypes it supports, what its device is, and which ddl client
module's collectives take its arrays. Nothing is imported until a world asks
(:func:`available`): a library that does not import is left out, with the reason.
To add a library (CuPy, torch on CUDA, JAX), write one subclass and add it to
:data:`IMPLS`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, List, Optional, Tuple

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES = [np.dtype(d) for d in (np.uint8, np.int8, np.uint16, np.int16, np.int32,
                                    np.int64, np.float16, BF16, np.float32, np.float64,
                                    np.bool_)]


class ArrayImpl:
    """One array library. Subclasses set ``name``, ``requires`` (modules that must import),
    ``client`` (the ddl module whose collectives take these arrays) and ``dtypes``."""

    name = "abstract"
    requires: Tuple[str, ...] = ()
    client = "ddl"
    dtypes: List[np.dtype] = ALL_DTYPES

    def installed(self) -> Optional[str]:
        """Why this library is not installed here (found without importing it), or None."""
        for module in self.requires:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                return f"{self.name}: {module.split('.')[0]} is not installed"
        return None

    def missing(self) -> Optional[str]:
        """Why this library cannot run here (it is imported), or None."""
        for module in self.requires:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - any import failure leaves it out
                return f"{self.name}: import {module} failed: {type(exc).__name__}: {exc}"
        return None

    def api(self):
        """The ddl client module: allreduce, allgather, broadcast, alltoall,
        reducescatter, grouped_allreduce with ddl's keywords."""
        return importlib.import_module(self.client)

    def from_numpy(self, a: np.ndarray) -> Any:
        """A new array of this library with ``a``'s dtype, shape and values."""
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        """A host NumPy copy of ``x`` (same dtype and shape)."""
        raise NotImplementedError

    def is_native(self, x: Any) -> bool:
        """Whether ``x`` is an array of this library."""
        raise NotImplementedError

    def device(self, x: Any) -> str:
        """Where ``x`` lives, as a comparable string."""
        return "cpu"

    def splits(self, s: Any) -> List[int]:
        """alltoall's received splits as a list of ints."""
        return [int(v) for v in np.asarray(self.to_numpy(s) if self.is_native(s) else s)]


class NumpyImpl(ArrayImpl):
    name = "numpy"
    requires = ("numpy",)

    def from_numpy(self, a):
        return a.copy()

    def to_numpy(self, x):
        return np.array(x, copy=True)

    def is_native(self, x):
        return isinstance(x, np.ndarray)


class TorchImpl(ArrayImpl):
    """torch tensors on the CPU; bfloat16 moves through an int16 view (NumPy's bfloat16
    is ml_dtypes', which torch does not read)."""

    name = "torch"
    # torch._dynamo before TensorFlow: with a CUDA build of torch (what pip installs on
    # Python 3.12 here), importing it after TensorFlow in one process crashes (SIGSEGV
    # in triton's import), and torch.optim imports it on the first optimizer
    requires = ("torch", "torch._dynamo", "ddl.torch")
    client = "ddl.torch"
    device_name = "cpu"

    def from_numpy(self, a):
        import torch
        if a.dtype == BF16:
            t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a.copy())
        return t.to(self.device_name)

    def to_numpy(self, x):
        import torch
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BF16).copy()
        return x.numpy().copy()

    def is_native(self, x):
        import torch
        return isinstance(x, torch.Tensor)

    def device(self, x):
        return str(x.device)


class TensorFlowImpl(ArrayImpl):
    """Eager TensorFlow tensors (tf.function and v1 graphs: tests/_tf_checks.py)."""

    name = "tensorflow"
    requires = ("tensorflow", "ddl.tensorflow")
    client = "ddl.tensorflow"

    def missing(self):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        return super().missing()

    def from_numpy(self, a):
        import tensorflow as tf
        return tf.constant(a.copy())

    def to_numpy(self, x):
        return np.array(x.numpy(), copy=True)

    def is_native(self, x):
        import tensorflow as tf
        return isinstance(x, tf.Tensor)

    def device(self, x):
        return x.device.rsplit("/", 1)[-1]


class MXNetImpl(ArrayImpl):
    """mx.nd.NDArray on the CPU (only in the MXNet environment, tests/test_mxnet.py)."""

    name = "mxnet"
    requires = ("mxnet", "ddl.mxnet")
    client = "ddl.mxnet"
    # mx.nd.array has no uint16, int16 or bfloat16 (it raises KeyError)
    dtypes = [d for d in ALL_DTYPES if d not in (np.uint16, np.int16, BF16)]

    def from_numpy(self, a):
        import mxnet as mx
        return mx.nd.array(a, dtype=a.dtype)

    def to_numpy(self, x):
        return x.asnumpy().copy()

    def is_native(self, x):
        import mxnet as mx
        return isinstance(x, mx.nd.NDArray)

    def device(self, x):
        return str(x.context)


class JaxImpl(ArrayImpl):
    """jax.Array on the CPU (only in the JAX environment, Python >= 3.12: tests/test_jax.py).
    Without ``jax_enable_x64`` JAX has no 64-bit types, so those are left out then."""

    name = "jax"
    requires = ("jax", "ddl.jax")
    client = "ddl.jax"

    @property
    def dtypes(self):
        import jax
        if jax.config.jax_enable_x64:
            return ALL_DTYPES
        return [d for d in ALL_DTYPES if d.itemsize < 8]

    def from_numpy(self, a):
        import jax
        return jax.device_put(a.copy())

    def to_numpy(self, x):
        return np.array(x, copy=True)

    def is_native(self, x):
        import jax
        return isinstance(x, jax.Array)

    def device(self, x):
        return str(next(iter(x.devices())))


class CupyImpl(ArrayImpl):
    """CuPy arrays, on the device data plane: on a GPU (tests/gpu), or the stand-in of
    tests/standin (host memory behind CuPy's interface) in the device worlds of
    tests/test_contract.py. Each rank's arrays live on GPU ``local_rank % device count``.
    CuPy has no bfloat16."""

    name = "cupy"
    requires = ("cupy",)
    dtypes = [d for d in ALL_DTYPES if d != BF16]

    def from_numpy(self, a):
        import cupy
        import ddl
        with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
            return cupy.asarray(a)

    def to_numpy(self, x):
        return x.get()

    def is_native(self, x):
        import cupy
        return isinstance(x, cupy.ndarray)

    def device(self, x):
        return f"cuda:{x.device.id}"


IMPLS: List[ArrayImpl] = [NumpyImpl(), TorchImpl(), TensorFlowImpl(), MXNetImpl(), JaxImpl(),
                          CupyImpl()]


def available(names: Optional[List[str]] = None) -> Tuple[List[ArrayImpl], List[str]]:
    """``(impls, skipped)``: the entries of :data:`IMPLS` (those named in ``names``, if
    given) that import here, and a reason for each one that does not."""
    impls, skipped = [], []
    for impl in IMPLS:
        if names is not None and impl.name not in names:
            continue
        why = impl.missing()
        if why is None:
            impls.append(impl)
        else:
            skipped.append(why)
    return impls, skipped
