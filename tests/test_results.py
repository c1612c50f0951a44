"""The pool of large results (ddl/runtime/results.py): memory comes back only once nothing uses it."""

import gc
import importlib.util

import numpy as np
import pytest

from ddl.runtime.results import ALIGN, ALIGN_MIN, ResultPool

KIB = 1024


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_dropped_result_is_recycled_and_one_in_use_never_is():
    pool = ResultPool(min_bytes=4 * KIB, max_bytes=64 * KIB)
    a = pool.empty(2048, np.float32)                    # 8 KiB: pooled
    a[:] = 1
    first = address(a)
    b = pool.empty((2, 1024), np.float32)                # a is alive: another block
    assert address(b) != first and b.shape == (2, 1024) and b.flags.c_contiguous
    del a
    gc.collect()
    c = pool.empty((4, 512), np.float32)                 # a's block, same bytes
    assert address(c) == first and c.dtype == np.float32 and c.shape == (4, 512)
    # anything made from a result keeps its block busy: a slice, a memoryview, a reshape,
    # a view as another dtype; once that goes, the block is idle and comes back
    for keep in (lambda x: x[1:], lambda x: memoryview(x), lambda x: x.reshape(-1),
                 lambda x: x.view(np.int32)):
        mine = address(c)
        held = keep(c)
        del c
        gc.collect()
        d = pool.empty((4, 512), np.float32)
        assert address(d) != mine, "a block still referenced was handed out again"
        blocks = pool.held_bytes()
        del held
        gc.collect()
        c = pool.empty((4, 512), np.float32)
        assert address(c) == mine and pool.held_bytes() == blocks
        del d
        gc.collect()
    # small results are plain arrays; other dtypes of the same byte size share blocks
    assert pool.empty(10, np.float64).base is None
    del c
    gc.collect()
    e = pool.empty(1024, np.float64)
    assert e.dtype == np.float64 and e.nbytes == 8 * KIB


def pooled(pool: ResultPool, x: np.ndarray) -> bool:
    return any(x.base is block for block in pool._blocks)


def test_the_pool_never_holds_more_than_its_bound():
    bound = 4 * (8 * KIB + ALIGN)  # a block has room to align its result
    pool = ResultPool(min_bytes=4 * KIB, max_bytes=bound)
    live = [pool.empty(2048, np.uint8) for _ in range(4)]      # 4 x 2 KiB: too small
    assert pool.held_bytes() == 0
    live = [pool.empty(8 * KIB, np.uint8) for _ in range(6)]   # 4 fit, 2 are plain
    assert pool.held_bytes() == bound
    assert sum(not pooled(pool, x) for x in live) == 2
    del live
    gc.collect()
    # idle blocks of another size make room for a new size
    big = pool.empty(16 * KIB, np.uint8)
    assert pooled(pool, big) and pool.held_bytes() <= bound


def test_a_block_serves_sizes_down_to_half_of_it_and_idle_blocks_are_bounded():
    pool = ResultPool(min_bytes=4 * KIB, max_bytes=1 << 20, max_idle_bytes=64 * KIB)
    a = pool.empty(16 * KIB, np.uint8)
    first = address(a)
    del a
    gc.collect()
    b = pool.empty(10 * KIB, np.uint8)          # fits the idle 16 KiB block
    assert address(b) == first and b.nbytes == 10 * KIB and pool.held_bytes() < 17 * KIB
    del b
    gc.collect()
    c = pool.empty(5 * KIB, np.uint8)           # under half of it: a block of its own
    assert address(c) != first and pooled(pool, c)
    del c
    gc.collect()
    # sizes that change: the idle blocks beyond max_idle_bytes are forgotten, oldest first
    for k in (40, 100, 300):
        x = pool.empty(k * KIB, np.uint8)
        assert pooled(pool, x)
        del x
        gc.collect()
    assert pool.held_bytes() == 300 * KIB + ALIGN


def test_results_from_a_page_up_start_on_an_aligned_address():
    """JAX adopts aligned host memory without copying (device_put, DLPack), and copies
    otherwise: every result of ALIGN_MIN bytes or more, pooled or not, is aligned."""
    pool = ResultPool(min_bytes=64 * KIB, max_bytes=1 << 20)
    for nbytes in (ALIGN_MIN, 3 * ALIGN_MIN + 8, 64 * KIB, 200 * KIB):
        for _ in range(3):  # new blocks and recycled ones
            x = pool.empty(nbytes // 4, np.float32)
            assert address(x) % ALIGN == 0 and x.nbytes == nbytes // 4 * 4
            del x
            gc.collect()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_torch_tensor_made_from_a_result_keeps_it():
    import torch
    pool = ResultPool(min_bytes=4 * KIB, max_bytes=64 * KIB)
    a = pool.empty(4096, np.float32)
    a[:] = 7.0
    first = address(a)
    t = torch.from_numpy(a)
    del a
    gc.collect()
    b = pool.empty(4096, np.float32)
    assert address(b) != first
    b[:] = 0.0
    t += 1  # still its own memory: the new result did not take it
    assert bool((t == 8.0).all()) and not b.any()
