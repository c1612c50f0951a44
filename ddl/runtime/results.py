"""Memory for large results: recycled once the caller has dropped them.

Collectives return new arrays, and a training loop drops last step's result when it gets
this step's. The allocator recycles the memory of small arrays; a large one comes
straight from the kernel (``mmap``) or from the top of the heap, which the allocator
gives back to the kernel when it is freed, so every step would pay to have the kernel
fault in and zero that much fresh memory again, a page at a time (a fifth of the time of
a 256 MiB allreduce over TCP; a third of the step of a 1 M-parameter MLP training on 2
ranks, whose 4 MB of gradient results faulted in 1,600 pages per step, measured).
:class:`ResultPool` keeps the blocks of results of ``MIN_BYTES`` or more it handed out and gives a block again once nothing refers to it any more: no
array, view, memoryview or framework tensor made from it (each holds a reference to the
block, which is what the pool counts).

A block is given again for a result of between half its size and all of it. The pool
holds at most ``max_bytes`` of blocks, results in use included (beyond that, new results
are plain allocations), and at most ``max_idle_bytes`` of idle ones (it forgets the
oldest). Thread-safe.

Results of :data:`ALIGN_MIN` bytes or more start on a :data:`ALIGN`-byte boundary: a
framework that can wrap host memory without copying (JAX's ``device_put``/DLPack on the
CPU) only does so for aligned memory, and copies otherwise.
(Cached calls of up to ``MIN_BYTES`` completed from a cycle's round on one host,
:mod:`ddl.runtime.cycles`, take plain allocations: aligning costs those calls more
than it saves.)
"""

from __future__ import annotations

import math
import sys
import threading
from typing import List, Sequence, Union

import numpy as np

MIN_BYTES = 256 << 10
MAX_BYTES = 1 << 30
MAX_IDLE_BYTES = 256 << 20  # idle blocks kept (a block is reused for sizes up to half it)
ALIGN = 64           # bytes: what XLA's CPU client asks of memory it adopts
ALIGN_MIN = 4096     # results smaller than this are cheaper to copy than to align


def _raw(nbytes: int) -> np.ndarray:
    """A new uint8 array that owns its memory, with room for an aligned ``nbytes``."""
    return np.empty(nbytes + ALIGN, np.uint8)


def _aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """The ``nbytes`` of ``raw`` (from :func:`_raw`) that start on an ``ALIGN`` boundary.
    A view: NumPy points its ``base`` at ``raw``, which is what the pool counts."""
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def _refs(blocks: List[np.ndarray], k: int) -> int:
    """``sys.getrefcount`` of ``blocks[k]`` (the one place the pool counts references)."""
    return sys.getrefcount(blocks[k])


# What _refs says of a block nothing else refers to, measured the same way (interpreters
# differ in what a call's arguments and temporaries add).
_IDLE_REFS = _refs([np.empty(1, np.uint8)], 0)


class ResultPool:
    """Recycles blocks of at least ``min_bytes`` for results (see the module doc)."""

    def __init__(self, min_bytes: int = MIN_BYTES, max_bytes: int = MAX_BYTES,
                 max_idle_bytes: int = MAX_IDLE_BYTES):
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._blocks: List[np.ndarray] = []  # uint8 blocks, oldest first
        self._held = 0

    def empty(self, shape: Union[int, Sequence[int]], dtype) -> np.ndarray:
        """An uninitialized C-contiguous array, like ``np.empty(shape, dtype)``.

        Few and cheap steps: it runs on every large result, right after the collective
        has flushed the CPU's caches, where each Python step costs several times more."""
        dtype = np.dtype(dtype)
        if type(shape) is int:  # the common case, in fewer steps
            nbytes = shape * dtype.itemsize
            if nbytes < ALIGN_MIN:
                return np.empty(shape, dtype)
            shape = None
        else:
            shape = (int(shape),) if isinstance(shape, np.integer) else \
                tuple(int(d) for d in shape)
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes < ALIGN_MIN:
                return np.empty(shape, dtype)
        block = None
        if nbytes >= self.min_bytes:
            with self._lock:
                block = self._take(nbytes)
        if block is None:
            block = _raw(nbytes)
        out = _aligned(block, nbytes).view(dtype)
        return out if shape is None else out.reshape(shape)

    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def _take(self, nbytes: int):
        """An idle block for ``nbytes`` (from :func:`_raw`), a new one if there is room,
        else None."""
        need = nbytes + ALIGN
        best = -1  # the smallest idle block that fits, at most twice the size needed
        idle = 0
        for k in range(len(self._blocks)):
            size = self._blocks[k].nbytes
            if _refs(self._blocks, k) != _IDLE_REFS:
                continue
            idle += size
            if need <= size <= 2 * need and (best < 0 or size < self._blocks[best].nbytes):
                best = k
        if best >= 0:
            block = self._blocks.pop(best)
            self._blocks.append(block)  # most recently used last
            return block
        if idle + need > self.max_idle_bytes:  # sizes that changed: forget old idle ones
            self._evict(idle + need - self.max_idle_bytes)
        if self._held + need > self.max_bytes:
            self._evict(self._held + need - self.max_bytes)
        if self._held + need > self.max_bytes:
            return None
        block = _raw(nbytes)
        self._blocks.append(block)
        self._held += block.nbytes
        return block

    def _evict(self, need: int) -> None:
        """Forget idle blocks, oldest first, until ``need`` bytes are free (or none is
        idle); a block in use is never forgotten, so ``max_bytes`` bounds both."""
        k = 0
        while k < len(self._blocks) and need > 0:
            if _refs(self._blocks, k) == _IDLE_REFS:
                need -= self._blocks[k].nbytes
                self._held -= self._blocks[k].nbytes
                del self._blocks[k]
            else:
                k += 1


RESULTS = ResultPool()  # the one pool of this process (every executor's results)
