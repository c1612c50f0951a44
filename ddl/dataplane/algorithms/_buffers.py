"""Buffer helpers shared by the algorithms: byte views, segment offsets, scratch space."""

from __future__ import annotations

import threading
from typing import List, Sequence

import numpy as np

_local = threading.local()


def check_array(buf, what: str) -> np.ndarray:
    """``buf`` as a 1-D C-contiguous array, or ``ValueError`` naming the problem. A NumPy
    array, or a device array with NumPy's interface (a CuPy array: the device data
    plane runs the same algorithms on device slots, :mod:`ddl.dataplane.device`)."""
    if not isinstance(buf, np.ndarray) and not _device_array(buf):
        raise ValueError(f"{what}: expected a 1-D NumPy array, got {type(buf).__name__}")
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"{what}: expected a 1-D contiguous array, got shape {buf.shape} "
                         f"(contiguous={buf.flags.c_contiguous})")
    return buf


def _device_array(buf) -> bool:
    return type(buf).__module__.startswith("cupy") and hasattr(buf, "flags")


def as_uint8(buf, what: str) -> np.ndarray:
    """A 1-D uint8 array over the bytes of ``buf`` (array, memoryview or bytes-like; a
    device array stays one)."""
    if isinstance(buf, np.ndarray) or _device_array(buf):
        check_array(buf, what)
        return buf.view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def even_offsets(total: int, parts: int) -> List[int]:
    """``parts + 1`` boundaries splitting ``total`` like ``np.array_split``."""
    q, r = divmod(total, parts)
    return [k * q + min(k, r) for k in range(parts + 1)]


def offsets(counts: Sequence[int]) -> List[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def check_counts(counts: Sequence[int], size: int, what: str) -> List[int]:
    counts = [int(c) for c in counts]
    if len(counts) != size:
        raise ValueError(f"{what}: expected {size} counts (one per member), got {len(counts)}")
    if any(c < 0 for c in counts):
        raise ValueError(f"{what}: counts must be >= 0, got {counts}")
    return counts


def scratch(nbytes: int) -> np.ndarray:
    """A uint8 scratch array of ``nbytes``, reused by later calls on the same thread."""
    pool = getattr(_local, "pool", None)
    if pool is None or pool.nbytes < nbytes:
        pool = np.empty(max(nbytes, 4096), dtype=np.uint8)
        _local.pool = pool
    return pool[:nbytes]
