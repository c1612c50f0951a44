"""A stand-in for CuPy on a machine without a GPU, for tests only: NOT CuPy.

ddl's device data plane (``ddl/dataplane/device``, ``ddl/runtime/device_execute.py``, the
CUDA IPC, NCCL and staged backends) is written against CuPy, and the GPU machines that run
it are lent to few sessions. Put ``tests/standin`` first on ``PYTHONPATH`` and ``import
cupy`` gives this package instead, so that every CI run drives that Python code end to
end, in real processes under ``ddlrun``: "device memory" is host memory, device arrays are
:class:`ndarray` objects that are *not* NumPy arrays (as CuPy's are not: NumPy refuses
to convert them implicitly, and a ufunc mixing them with NumPy arrays raises TypeError),
kernels are NumPy calls queued on the current stream (run at once, or, with
``DDL_TEST_LAZY_STREAMS=1``, only when something waits for them: :mod:`cupy.cuda`),
``empty`` reuses memory in stream order as CuPy's pool does (``_POOL``), CUDA
IPC is POSIX shared memory (:mod:`cupy.cuda.runtime`) and NCCL a stand-in over
``/dev/shm`` (:mod:`cupy.cuda.nccl`). What it cannot show: device memory, real
concurrency, or speed (tests/gpu does, on a GPU).
"""

from __future__ import annotations

import ctypes
import numbers
import threading

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from . import cuda
from .cuda import _state

__version__ = "0.0.0+ddl-standin"
STANDIN = True

# dtypes and constants under CuPy's names
from numpy import (bool_, complex64, complex128, dtype, float16, float32, float64,  # noqa: E402
                   inf, int8, int16, int32, int64, nan, uint8, uint16, uint32, uint64)


def _at(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def _unwrap(x, strict: bool):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, strict) for v in x)
    if strict and isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)} (a NumPy array among CuPy arrays: "
                        f"the stand-in refuses it, as CuPy does)")
    return x


def _device_of(values) -> int:
    for v in values:
        if isinstance(v, ndarray):
            return v._device
        if isinstance(v, (list, tuple)):
            found = _device_of(v)
            if found is not None:
                return found
    return None


def _later(fn) -> None:
    """Queue ``fn`` (array work) on the current stream."""
    cuda.current_queue().put(fn)


def _sync() -> None:
    """A host read: everything queued on the current stream first."""
    cuda.current_queue().run_all()


def _wrap(x, device: int, keep=None):
    if isinstance(x, np.ndarray):
        return ndarray._of(x, device, keep)
    if isinstance(x, tuple):
        return tuple(_wrap(v, device, keep) for v in x)
    if isinstance(x, list):
        return [_wrap(v, device, keep) for v in x]
    return x


class ndarray(NDArrayOperatorsMixin):
    """A device array of the stand-in: a NumPy array inside (``_a``), the device it
    belongs to, and whatever keeps its memory alive."""

    __slots__ = ("_a", "_device", "_keep")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(shape)
        if memptr is None:
            made = _pooled(shape, dtype, _state.device())
            self._a, self._device, self._keep = made._a, made._device, made._keep
            return
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._a = _at(memptr.ptr, nbytes).view(dtype).reshape(shape)
        self._device, self._keep = memptr.device_id, memptr

    @classmethod
    def _of(cls, a: np.ndarray, device: int, keep=None) -> "ndarray":
        out = cls.__new__(cls)
        out._a, out._device, out._keep = a, device, keep
        return out

    def _same(self, a) -> "ndarray":
        return ndarray._of(a, self._device, self._keep) if isinstance(a, np.ndarray) else a

    # -- NumPy's protocols: ufuncs and functions run on the arrays inside ---------------
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        device = _device_of(inputs + tuple(kwargs.get("out", ()) or ()))
        if "where" in kwargs:
            raise TypeError("the stand-in, as CuPy, has no `where=` in ufuncs")
        args = _unwrap(inputs, True)
        if method == "__call__" and ufunc.signature is None:   # a kernel: its outputs
            # now, their values in order (gufuncs such as matmul, whose shapes are not
            # broadcasts, run at once below)
            out = kwargs.pop("out", None)
            if out is None:   # the outputs' dtypes: the ufunc's on one element each
                with np.errstate(all="ignore"):
                    probe = ufunc(*(np.ones(1, a.dtype) if isinstance(a, np.ndarray) else a
                                    for a in args), **kwargs)
                shape = np.broadcast_shapes(*(np.shape(a) for a in args))
                made = tuple(_pooled(shape, np.asarray(p).dtype, device)
                             for p in (probe if isinstance(probe, tuple) else (probe,)))
                out = tuple(m._a for m in made)
                _later(lambda: ufunc(*args, out=out, **kwargs))
                return made[0] if len(made) == 1 else made
            out = tuple(_unwrap(o, True) for o in (out if isinstance(out, tuple) else (out,)))
            _later(lambda: ufunc(*args, out=out, **kwargs))
            return _wrap(out[0] if len(out) == 1 else out, device)
        _sync()   # reductions and the like: at once, after what is queued
        if "out" in kwargs:
            kwargs["out"] = _unwrap(kwargs["out"], True)
        return _wrap(getattr(ufunc, method)(*args, **kwargs), device)

    def __array_function__(self, func, types, args, kwargs):
        device = _device_of(tuple(args) + tuple(kwargs.values()))
        args = _unwrap(args, True)
        kwargs = {k: _unwrap(v, True) for k, v in kwargs.items()}
        if func is np.copyto:
            _later(lambda: func(*args, **kwargs))
            return None
        if func in (np.empty_like, np.shape, np.ndim, np.size):
            return _wrap(func(*args, **kwargs), device)
        _sync()   # anything else: at once, after what is queued
        return _wrap(func(*args, **kwargs), device)

    # -- attributes ----------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self._same(self._a.T))

    @property
    def data(self) -> cuda.MemoryPointer:
        mem = cuda.UnownedMemory(self._a.ctypes.data, self._a.nbytes, self, self._device)
        return cuda.MemoryPointer(mem, 0)

    @property
    def device(self) -> cuda.Device:
        return cuda.Device(self._device)

    # -- methods -------------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        _sync()
        return np.array(self._a, copy=True, order=order)

    def set(self, arr, stream=None) -> None:
        arr = np.array(arr, copy=True)
        if arr.shape != self._a.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._a.shape}, new shape: "
                             f"{arr.shape}")
        a = self._a
        _later(lambda: a.__setitem__(Ellipsis, arr))

    def __getitem__(self, index):
        index = _unwrap(index, False)
        got = self._a[index]
        if isinstance(got, np.ndarray) and np.may_share_memory(got, self._a):
            return self._same(got)   # a view: nothing to compute
        _sync()   # an element or a gathered copy: read now
        got = self._a[index]
        return self._same(got if isinstance(got, np.ndarray) else np.asarray(got))

    def __setitem__(self, index, value) -> None:
        if isinstance(value, np.ndarray):   # host values: as they are now
            value = value.copy()
        a, index, value = self._a, _unwrap(index, False), _unwrap(value, False)
        _later(lambda: a.__setitem__(index, value))

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __bool__(self) -> bool:
        _sync()
        return bool(self._a)

    def __int__(self) -> int:
        _sync()
        return int(self._a)

    def __float__(self) -> float:
        _sync()
        return float(self._a)

    def __index__(self) -> int:
        _sync()
        return self._a.__index__()

    def __repr__(self) -> str:
        _sync()
        return f"array({self._a.tolist()!r}, dtype={self._a.dtype}) (stand-in, cuda:{self._device})"

    __hash__ = None

    def item(self):
        _sync()
        return self._a.item()

    def tolist(self):
        _sync()
        return self._a.tolist()

    def _copy_of(self, dtype=None) -> "ndarray":
        a = self._a
        made = _pooled(a.shape, dtype or a.dtype, self._device)
        out = made._a
        _later(lambda: np.copyto(out, a, casting="unsafe"))
        return made

    def reshape(self, *shape, order="C"):
        if not self._a.flags.c_contiguous:
            _sync()
        return self._same(self._a.reshape(*shape, order=order))

    def ravel(self, order="C"):
        return self.reshape(-1)

    def flatten(self, order="C"):
        return self._copy_of().reshape(-1)

    def view(self, dtype=None):
        return self._same(self._a.view(dtype) if dtype is not None else self._a.view())

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self._a.dtype:
            return self
        return self._copy_of(np.dtype(dtype))

    def copy(self, order="C"):
        return self._copy_of()

    def fill(self, value) -> None:
        a = self._a
        _later(lambda: a.fill(value))

    def __getattr__(self, name):
        # reductions and the like (all, any, sum, max, min, mean, ...): NumPy's, wrapped,
        # at once after what is queued
        method = getattr(self._a, name)
        if not callable(method):
            raise AttributeError(name)

        def call(*args, **kwargs):
            _sync()
            return _wrap(method(*_unwrap(args, True),
                                **{k: _unwrap(v, True) for k, v in kwargs.items()}),
                         self._device)
        return call


# -- creating arrays ---------------------------------------------------------------------
def _new(a: np.ndarray) -> ndarray:
    """A new device array holding ``a``'s values: pool memory (``empty``), written on the
    current stream."""
    if a.nbytes == 0 or not a.flags.c_contiguous:
        return ndarray._of(a, _state.device())
    out = empty(a.shape, a.dtype)
    dst = out._a
    _later(lambda: np.copyto(dst, a))
    return out


class _Pooled:
    """A block of the pool held by arrays (their ``_keep``); when the last one goes, the
    block goes back to the stream it was taken on, whatever is still queued to read it."""

    __slots__ = ("key", "block", "ptr")

    def __init__(self, key: tuple, block: np.ndarray):
        self.key, self.block, self.ptr = key, block, block.ctypes.data

    def __del__(self):
        with _POOL_LOCK:
            _POOL.setdefault(self.key, []).append(self.block)


# CuPy's memory pool, as far as ordering goes: ``empty`` (and every function that makes
# an array of values) takes a block freed on the current stream (of the same rounded
# size and device) at once, with work still queued that reads it, since a kernel holds a
# pointer and not a reference. A program must order a block's last use before its next
# owner's first one, as on a GPU. Blocks are kept for the process's life, so late reads
# see the next owner's bytes, never unmapped memory.
_POOL: dict = {}
_POOL_LOCK = threading.RLock()


def _pooled(shape, dtype, device: int) -> ndarray:
    """An uninitialised array of the pool on ``device`` (C order)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return ndarray._of(np.empty(shape, dtype), device)
    key = (device, cuda.get_current_stream().ptr, -(-nbytes // 512) * 512)
    with _POOL_LOCK:
        free = _POOL.get(key)
        block = free.pop() if free else np.empty(key[2], np.uint8)
    mem = _Pooled(key, block)
    return ndarray._of(_at(mem.ptr, nbytes).view(dtype).reshape(shape), device, mem)


def empty(shape, dtype=float, order="C") -> ndarray:
    if order != "C":
        return ndarray._of(np.empty(shape, dtype, order), _state.device())
    return _pooled(shape, dtype, _state.device())


def zeros(shape, dtype=float, order="C") -> ndarray:
    return _new(np.zeros(shape, dtype, order))


def ones(shape, dtype=float, order="C") -> ndarray:
    return _new(np.ones(shape, dtype, order))


def full(shape, fill_value, dtype=None, order="C") -> ndarray:
    return _new(np.full(shape, fill_value, dtype, order))


def arange(*args, **kwargs) -> ndarray:
    return _new(np.arange(*args, **kwargs))


def empty_like(a, dtype=None, order="K", shape=None) -> ndarray:
    return _new(np.empty_like(a._a, dtype, order, shape=shape))


def zeros_like(a, dtype=None, order="K", shape=None) -> ndarray:
    return _new(np.zeros_like(a._a, dtype, order, shape=shape))


def ones_like(a, dtype=None, order="K", shape=None) -> ndarray:
    return _new(np.ones_like(a._a, dtype, order, shape=shape))


def array(obj, dtype=None, copy=True, order="K", ndmin=0) -> ndarray:
    if isinstance(obj, ndarray):
        return obj._copy_of(dtype)
    return _new(np.array(obj, dtype, copy=True, order=order, ndmin=ndmin))


def asarray(a, dtype=None, order=None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _new(np.array(a, dtype, copy=True, order=order or "K"))


def ascontiguousarray(a, dtype=None) -> ndarray:
    if isinstance(a, ndarray):
        if a._a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return a._copy_of(dtype)
    return _new(np.ascontiguousarray(a, dtype))


def asnumpy(a, stream=None, order="C", out=None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a, order=order)


def get_array_module(*args):
    import sys
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


# -- kernels -----------------------------------------------------------------------------
def _bf16_to_f32(x, out):
    bits = (x.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.copyto(out, bits)


def _f32_to_bf16(x, out):
    u = x.view(np.uint32)
    nan_ = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | 0x40).astype(np.uint16)
    np.copyto(out, np.where(nan_, quiet, rounded).view(np.int16))


_KERNELS = {"ddl_bf16_to_f32": (_bf16_to_f32, np.float32),
            "ddl_f32_to_bf16": (_f32_to_bf16, np.int16)}


class ElementwiseKernel:
    """Only the kernels ddl defines, by name, as NumPy code."""

    def __init__(self, in_params, out_params, operation, name="kernel", **kwargs):
        if name not in _KERNELS:
            raise NotImplementedError(f"the stand-in has no kernel {name!r}")
        self.name = name

    def __call__(self, x, out=None):
        fn, dtype = _KERNELS[self.name]
        if out is None:
            out = _pooled(x.shape, dtype, x._device)
        a, b = x._a, out._a
        _later(lambda: fn(a, b))
        return out


def __getattr__(name):
    # NumPy's functions under CuPy's names (isnan, concatenate, ...): they dispatch to
    # ndarray's protocols, so they take and give stand-in arrays
    found = getattr(np, name)
    if callable(found):
        return found
    raise AttributeError(name)
