"""Memory a training step frees is kept for the next step, not given back to the kernel.

A training loop allocates and frees the same buffers every step: activations, gradients,
a collective's results. glibc's malloc serves a request of its *mmap threshold* or more
with a fresh ``mmap`` and unmaps it when it is freed, and gives the top of its heap back
to the kernel once more than its *trim threshold* of it is free. Both thresholds start
low (128 KiB) and only follow the largest block freed so far (the trim threshold at
twice it), so a step whose buffers of a few MiB are freed together gives them back, and
the next step pays the kernel to fault them in and zero them again, a page at a time.
Measured on a small CNN (1.2 M parameters, batch 32, 2 ranks on 2 CPUs): 1,900 page
faults in every backward pass with plain torch and 2,700-3,200 under
``DistributedOptimizer``, which took 3-4 ms of a 25-31 ms step; see
docs/performance.md. The allocators PyTorch's CPU tuning guide recommends (jemalloc,
tcmalloc) keep such memory by default.

:func:`retain` tells glibc once, with ``mallopt``, to keep up to ``nbytes`` of freed
memory at the top of each of its heaps (``M_TRIM_THRESHOLD``) and to serve requests
below 32 MiB from the heap (``M_MMAP_THRESHOLD``: the most glibc accepts; larger blocks
are few per step). The cost: memory that the process freed stays resident, up to
``nbytes`` per heap. It is a setting of this process (and of the children it forks
without exec, such as data-loader workers), taken by :func:`ddl.init` from
``DDL_MALLOC_RETAIN_MB`` (0 leaves malloc as it is), and left alone where the user
already tuned malloc through its environment variables or where the C library is not
glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping, Optional

log = logging.getLogger("ddl")

_M_TRIM_THRESHOLD = -1   # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20   # the largest M_MMAP_THRESHOLD glibc takes on 64-bit hosts

# Environment through which a user tunes malloc (glibc's own, and preloaded allocators):
# where one is set, ddl leaves malloc alone.
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_", "MALLOC_CONF", "TCMALLOC_RELEASE_RATE")


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own symbol: absent on musl and others
        return libc
    except (OSError, AttributeError, TypeError):   # (TypeError: Windows takes no None)
        return None


def user_tuned(env: Mapping[str, str]) -> Optional[str]:
    """The variable through which the user already tuned malloc, or None."""
    for name in _USER_SETTINGS:
        if env.get(name):
            return name
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def retain(nbytes: int, env: Mapping[str, str] = os.environ) -> bool:
    """Keep up to ``nbytes`` of freed memory in this process (see the module doc).
    Returns whether malloc took the setting; idempotent."""
    if nbytes <= 0:
        return False
    tuned = user_tuned(env)
    if tuned is not None:
        log.debug("ddl: %s is set: malloc's thresholds are left as they are", tuned)
        return False
    libc = _glibc()
    if libc is None:
        return False
    # any mallopt ends glibc's own adjusting of both thresholds, so the mmap threshold is
    # always set to its most: a lower one would map and fault in every block above it
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, min(nbytes, 2**31 - 1)) == 1)
    if not ok:
        log.debug("ddl: mallopt refused the thresholds for DDL_MALLOC_RETAIN_MB")
    return ok
