"""DDL_MALLOC_RETAIN_MB: after ddl.init(), memory a step frees is reused without faults.

Each case is a real process that calls ddl.init() (a job of one) and then counts the page
faults of a loop that allocates and fills four 4 MiB arrays and then frees them, as a
training step does with its buffers. By default glibc gives the 16 MiB back to the kernel
at the end of each pass (more than twice the largest block freed is free at the top of its
heap), and the next pass faults it in again (4,096 faults); with ddl's setting the next
pass reuses it.
"""

import os
import subprocess
import sys

import pytest

from ddl.startup import heap

PROGRAM = r"""
import resource
import numpy as np
import ddl

ddl.init()

def faults(passes):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(passes):
        step = [np.ones((4 << 20) // 8) for _ in range(4)]
        del step
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults(3)
print(faults(20))
ddl.shutdown()
"""

PASSES, PAGES = 20, (16 << 20) // 4096


def _glibc() -> bool:
    return heap._glibc() is not None


@pytest.mark.skipif(not _glibc(), reason="DDL_MALLOC_RETAIN_MB tunes glibc's malloc: "
                                         "this Python runs on another C library")
def test_freed_memory_is_kept_unless_turned_off_or_tuned_by_the_user():
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DDL_", "MALLOC_")) and k != "GLIBC_TUNABLES"}
    base["NUMPY_MADVISE_HUGEPAGE"] = "0"   # a page fault per 4 KiB, as the bounds count
    cases = {"default": {},
             "off": {"DDL_MALLOC_RETAIN_MB": "0"},
             # the user's own setting wins: 4 MiB stays above this mmap threshold
             "user": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
    procs = {name: subprocess.Popen([sys.executable, "-c", PROGRAM], env={**base, **extra},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, extra in cases.items()}
    faults = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, (name, err[-3000:])
        faults[name] = int(out.split()[-1])
    assert faults["default"] < PAGES, faults  # under one pass's pages in all 20 passes
    assert faults["off"] > PASSES * PAGES // 4, faults
    assert faults["user"] > PASSES * PAGES // 4, faults


def test_what_counts_as_the_user_tuning_malloc():
    assert heap.user_tuned({}) is None
    assert heap.user_tuned({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_"
    assert heap.user_tuned({"MALLOC_CONF": "dirty_decay_ms:-1"}) == "MALLOC_CONF"
    assert heap.user_tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == \
        "GLIBC_TUNABLES"
    assert heap.user_tuned({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
    assert heap.retain(0) is False
    assert heap.retain(1 << 20, {"MALLOC_MMAP_THRESHOLD_": "1"}) is False
