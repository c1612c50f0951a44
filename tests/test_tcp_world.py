"""Harness for data-plane tests: N TcpTransports on loopback, one thread per rank.

Also holds the basic point-to-point tests of :class:`ddl.dataplane.transports.tcp.TcpTransport`.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import numpy as np
import pytest

from ddl.dataplane.transports.tcp import TcpTransport

SECRET = bytes(range(32))
JOB_ID = "00112233aabbccdd"


def make_world(n, secret=SECRET, job_id=JOB_ID, **kwargs):
    """``n`` listening transports that know each other's addresses."""
    world = [TcpTransport(r, n, secret, job_id, **kwargs) for r in range(n)]
    addresses = {r: t.listen() for r, t in enumerate(world)}
    for t in world:
        t.set_peers(addresses)
    return world


def close_world(world):
    for t in world:
        t.close()


def run_threads(n, fn, timeout=30.0, ranks=None):
    """Run ``fn(i)`` for ``i`` in ``ranks`` (default ``range(n)``) on threads.

    Returns the results in order. Re-raises the first exception (by rank) with every
    failing rank's traceback attached; fails if a thread is still running at ``timeout``.
    """
    ranks = list(range(n)) if ranks is None else list(ranks)
    results = {}
    errors = {}

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - propagated below
            errors[i] = (exc, traceback.format_exc())

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in ranks]
    for t in threads:
        t.start()
    stop = time.monotonic() + timeout
    for i, t in zip(ranks, threads):
        t.join(max(0.0, stop - time.monotonic()))
        if t.is_alive():
            raise AssertionError(f"rank {i} still running after {timeout} s")
    if errors:
        first = min(errors)
        details = "\n".join(f"--- rank {i} ---\n{tb}" for i, (_, tb) in sorted(errors.items()))
        sys.stderr.write(details)
        raise errors[first][0]
    return [results[i] for i in ranks]


@pytest.fixture
def world3():
    world = make_world(3, poll_interval=0.05)
    yield world
    close_world(world)


@pytest.mark.timeout(20)
def test_send_recv_both_directions_on_one_connection(world3):
    data = np.arange(1 << 20, dtype=np.uint8)

    def fn(r):
        t = world3[r]
        dl = time.monotonic() + 10
        if r == 0:
            t.send(2, memoryview(data), dl)
            back = np.empty_like(data)
            t.recv_into(2, memoryview(back), dl)
            return back
        if r == 2:
            got = np.empty_like(data)
            t.recv_into(0, memoryview(got), dl)
            t.send(0, memoryview(got[::-1].copy()), dl)
            return got
        return None

    back, _, got = run_threads(3, fn)
    np.testing.assert_array_equal(got, data)
    np.testing.assert_array_equal(back, data[::-1])


@pytest.mark.timeout(20)
def test_sendrecv_ring_with_chunk_callbacks(world3):
    n = 3
    size = 3 * 4096 + 17

    def fn(r):
        t = world3[r]
        out = np.full(size, r, dtype=np.uint8)
        into = np.empty(size, dtype=np.uint8)
        seen = []
        t.sendrecv((r + 1) % n, memoryview(out), (r - 1) % n, memoryview(into),
                   time.monotonic() + 10, on_recv=lambda a, b: seen.append((a, b)), chunk=4096)
        return into, seen

    for r, (into, seen) in enumerate(run_threads(n, fn)):
        assert (into == (r - 1) % n).all()
        assert seen == [(0, 4096), (4096, 8192), (8192, 12288), (12288, size)]


@pytest.mark.timeout(20)
def test_zero_length_and_connect_all(world3):
    empty = memoryview(bytearray())
    t0 = world3[0]
    t0.send(1, empty, time.monotonic() + 1)       # returns at once, no connection needed
    t0.recv_into(2, empty, time.monotonic() + 1)
    t0.sendrecv(1, empty, 2, empty, time.monotonic() + 1)
    run_threads(3, lambda r: world3[r].connect_all(range(3), time.monotonic() + 10))
    assert sorted(world3[1]._conns) == [0, 2]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 3 is outside 0..2"):
        TcpTransport(3, 3, SECRET, JOB_ID)
    t = TcpTransport(0, 2, SECRET, JOB_ID)
    try:
        with pytest.raises(ValueError, match="no data-plane address for rank 1"):
            t.send(1, memoryview(b"x"), time.monotonic() + 1)
        with pytest.raises(ValueError, match="peer rank 0 is not another rank"):
            t.send(0, memoryview(b"x"), time.monotonic() + 1)
        with pytest.raises(ValueError, match="host:port"):
            t.set_peers({1: "nonsense"})
    finally:
        t.close()
