"""jax.Array in and out of ddl's data plane.

A CPU array reaches the data plane as a read-only NumPy view of its buffer (no copy); a
result comes back as a ``jax.Array`` on the input's device through ``jax.device_put``,
which adopts the result's memory without copying on the CPU (ddl's results of a page or
more are 64-byte aligned, as XLA asks). bfloat16 is the same ``ml_dtypes`` type on both
sides. An array on a GPU stays there when the device data plane is there (CuPy): it
reaches the collective through DLPack (no copy), and the result goes back the same way,
both ordered with JAX's stream by the DLPack exchange itself (bfloat16 crosses as its
uint16 bits, one device copy each way, and the way back waits for its copy on the host:
CuPy before 14 has no DLPack bfloat16); without CuPy it is staged through host memory. A
traced value (inside ``jax.jit``, ``grad``, ``scan``) has no bytes yet: the core
collectives refuse it, naming the ``ddl.jax`` function that takes it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddl import ArrayAdapter


class JaxAdapter(ArrayAdapter):
    """Converts ``jax.Array`` to and from NumPy for the core collectives."""

    name = "jax"

    def supports(self, x: Any) -> bool:
        return isinstance(x, jax.Array)

    def to_numpy(self, x: Any) -> np.ndarray:
        return to_numpy(x)

    def from_numpy(self, arr: np.ndarray, like: Any) -> Any:
        return jax.device_put(arr, device_of(like))

    def memory(self, x: Any) -> str:
        if isinstance(x, jax.core.Tracer):
            return ""   # no bytes anywhere yet: to_numpy says why it is refused
        return memory_of(device_of(x))

    def to_device(self, x: Any) -> Any:
        to_numpy_problem(x)
        device = device_of(x)
        if memory_of(device) != "cuda":
            return None
        from ddl._client_api import device_arrays as cuda
        cp = cuda.cupy()
        index = getattr(device, "local_hardware_id", None)
        index = device.id if index is None else index
        owner = x
        if x.dtype == jnp.bfloat16:   # DLPack's bfloat16: not in CuPy before 14
            with jax.default_device(device):   # (an uncommitted x: its copy stays there)
                owner = jax.lax.bitcast_convert_type(x, jnp.uint16)
        with cp.cuda.Device(index), cuda.stream(index):   # the data plane's stream waits
            data = cp.ascontiguousarray(cp.from_dlpack(owner))
        data = data.view(cuda.storage_dtype(x.dtype))
        return cuda.DeviceArray(data, np.dtype(x.dtype), tuple(x.shape), index, None, owner)

    def from_device(self, result: Any, like: Any, stream: int) -> Any:
        from ddl._client_api import device_arrays as cuda
        cp = cuda.cupy()
        data, bf16 = result.data, result.dtype == jnp.bfloat16
        if bf16:   # its bits as uint16 through DLPack, as to_device
            data = data.view(np.uint16)
        with cp.cuda.Device(result.device), cuda.stream(result.device):
            # JAX's stream waits for the data plane's, which waits for the result
            cuda.stream(result.device).wait_event(result.event)
            out = jax.dlpack.from_dlpack(data)
        if not bf16:
            return out
        # JAX's copy reads the result's memory: it must be done before that memory goes
        # back to the pool when ``out`` is dropped (JAX's streams need not wait for the
        # event the release records); one host wait, on this path only
        with jax.default_device(out.devices().pop()):
            copied = jax.lax.bitcast_convert_type(out, jnp.bfloat16)
        return copied.block_until_ready()


def to_numpy(x: jax.Array) -> np.ndarray:
    """A host NumPy array with ``x``'s values: a view of its buffer on the CPU."""
    to_numpy_problem(x)
    device_of(x)
    return np.asarray(x)


def to_numpy_problem(x: jax.Array) -> None:
    """TypeError for a traced value, which has no bytes yet."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError("it is a traced JAX value (inside jax.jit, grad, scan or vmap), "
                        "which has no values yet: call the collective from ddl.jax "
                        "(ddl.jax.allreduce and friends work inside transformations)")


def memory_of(device: Any) -> str:
    """``Request.memory`` for an array on ``device``: "" on the CPU, "cuda" on a GPU (as
    torch names its GPUs, on ROCm too), else the platform's name ("tpu")."""
    platform = device.platform
    if platform == "cpu":
        return ""
    return "cuda" if platform in ("gpu", "cuda", "rocm") else platform


def device_of(x: jax.Array):
    """The one device ``x`` lives on; TypeError for an array sharded over several."""
    devices = x.devices()
    if len(devices) != 1:
        raise TypeError(f"ddl collectives take an array on one device; this one is sharded "
                        f"over {len(devices)} devices ({x.sharding}): each process passes "
                        f"its own shard (x.addressable_shards[i].data)")
    return next(iter(devices))
