"""Shared-memory collectives in worlds of real processes, checked against NumPy.

Also holds the harness the other ``test_shm_*`` modules use: :func:`run_world` starts
``n`` fresh Python processes (subprocess), each joins one :class:`ShmGroup` and runs a
module-level function; results come back on its stdout, tracebacks of failed ranks are
shown, and a world that outlives its timeout is killed and fails the test.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import secrets
import subprocess
import sys
import time
import traceback

import ml_dtypes
import numpy as np
import pytest

from ddl.core.dtypes import ReduceOp
from ddl.core.errors import MismatchError, PeerLostError, ShutdownError
from ddl.dataplane.algorithms import _shm_allreduce, _shm_broadcast
from ddl.dataplane.algorithms import shm_collectives as shm
from ddl.dataplane.transports.shm import ShmGroup, available, segment_prefix

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not available(), reason="needs Linux futexes and /dev/shm")]

HOST = "test-host"
DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16,
          ml_dtypes.bfloat16, np.float32, np.float64, np.bool_]
OPS = [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]
SLOT = 4096          # the smallest slot: every size below 4 KiB crosses chunk boundaries


# -- harness --------------------------------------------------------------------------------
def _child_main():
    """A spawned rank: read its orders (pickled) on stdin, answer (pickled) on stdout."""
    rank, n, job_id, secret, group_kwargs, fn, args = pickle.load(sys.stdin.buffer)
    try:
        group = ShmGroup(job_id, secret, HOST, rank, n, **group_kwargs)
        group.connect(time.monotonic() + 20)
        try:
            answer = (True, fn(group, *args))
        finally:
            group.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        answer = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    sys.stdout.buffer.write(pickle.dumps(answer))
    sys.stdout.flush()


class World:
    """``n`` processes running ``fn(group, *args)`` (a module-level function of a test
    module) in one group; the secret travels on stdin, never on a command line. ``start``
    lists the ranks to start (default: all); ``procs`` maps each to its Popen."""

    def __init__(self, n, fn, *args, job_id=None, secret=None, start=None, **group_kwargs):
        self.job_id = job_id or secrets.token_hex(8)
        self.secret = secret or os.urandom(32)
        code = "import test_shm_collectives as t; t._child_main()"
        self.procs = {}
        for rank in range(n) if start is None else start:
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
            p.stdin.write(pickle.dumps((rank, n, self.job_id, self.secret, group_kwargs, fn,
                                        args)))
            p.stdin.close()
            p.stdin = None    # communicate() must not flush it again
            self.procs[rank] = p

    def collect(self, timeout=30.0, ranks=None):
        """Each listed rank's result; fails with every failed rank's traceback."""
        ranks = sorted(self.procs) if ranks is None else list(ranks)
        stop = time.monotonic() + timeout
        got = {}
        try:
            for r in ranks:
                try:
                    out, _ = self.procs[r].communicate(timeout=max(0.01, stop - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"rank {r} still running after {timeout} s") from None
                got[r] = pickle.loads(out) if out else (False, "exited without an answer, "
                                                        f"code {self.procs[r].returncode}")
        finally:
            self.stop()
        failed = {r: out for r, (ok, out) in got.items() if not ok}
        if failed:
            raise AssertionError("".join(f"\n--- rank {r} ---\n{tb}"
                                         for r, tb in sorted(failed.items())))
        return [got[r][1] for r in ranks]

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()


def run_world(n, fn, *args, timeout=30.0, **group_kwargs):
    world = World(n, fn, *args, **group_kwargs)
    results = world.collect(timeout)
    assert leftover_segments(world.job_id) == []
    return results


_HOLDER = """
import sys, numpy as np
token = np.frombuffer(b"ddl-cma-probe-16", np.uint8).copy()
print(token.ctypes.data, flush=True)
sys.stdin.read()
"""
_READER = """
import sys, numpy as np
from ddl.dataplane.transports import _cma
got = np.zeros(16, np.uint8)
_cma.read(int(sys.argv[1]), int(sys.argv[2]), got)
sys.exit(0 if got.tobytes() == b"ddl-cma-probe-16" else 1)
"""
_sibling_cma = None


def siblings_can_cma() -> bool:
    """Whether one child process of this one may read another's memory (what the ranks
    of a world are to each other): Yama's ptrace_scope 1 or a container may refuse."""
    global _sibling_cma
    if _sibling_cma is None:
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            address = holder.stdout.readline().strip()
            reader = subprocess.run([sys.executable, "-c", _READER, str(holder.pid), address],
                                    capture_output=True, timeout=30)
            _sibling_cma = reader.returncode == 0
        finally:
            holder.stdin.close()
            holder.wait(10)
    return _sibling_cma


def leftover_segments(job_id):
    return [f for f in os.listdir("/dev/shm") if f.startswith(segment_prefix(job_id))]


# -- reference data -------------------------------------------------------------------------
def sample(dtype, op, rank, count, seed):
    """Small integers, so that every reduction order gives exactly the same result."""
    rng = np.random.default_rng([seed, rank, count])
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    if op == ReduceOp.Product:
        choices = [1, 2] if dtype.kind == "u" else [1, 2, -1]
    else:
        choices = list(range(0, 4)) if dtype.kind == "u" else list(range(-3, 4))
    return np.asarray(rng.choice(choices, count), dtype=np.float64).astype(dtype)


def expected(dtype, op, n, count, seed):
    data = [sample(dtype, op, r, count, seed) for r in range(n)]
    if np.dtype(dtype) == np.bool_:
        return np.logical_and.reduce(data) if op == ReduceOp.Min else np.logical_or.reduce(data)
    wide = np.stack([d.astype(np.float64) for d in data])
    fn = {ReduceOp.Sum: np.sum, ReduceOp.Min: np.min, ReduceOp.Max: np.max,
          ReduceOp.Product: np.prod}[op]
    return fn(wide, axis=0).astype(dtype)


def sizes(n):
    """0, 1, n-1, n+1, within one slot, across slots (not a multiple), beyond the segment."""
    return sorted({0, 1, n - 1, n + 1, 333, 1000, 3001, 3 * n * SLOT + 7})


def _allreduce_cases(group):
    n, rank, failures = group.size, group.index, []
    _shm_allreduce.ALLREDUCE_CMA_PIECE = 4096   # many pieces, the last one short
    for algorithm in shm.ALLREDUCE_ALGORITHMS:
        for dtype in DTYPES:
            for op in OPS:
                if np.dtype(dtype) == np.bool_ and op in (ReduceOp.Sum, ReduceOp.Product):
                    continue
                for count in sizes(n):
                    x = sample(dtype, op, rank, count, seed=int(op))
                    shm.allreduce(x, op, group, time.monotonic() + 10, algorithm=algorithm)
                    want = expected(dtype, op, n, count, seed=int(op))
                    if x.dtype != want.dtype or not np.array_equal(x, want):
                        failures.append(f"{np.dtype(dtype)} {op.name} count={count} "
                                        f"{algorithm}")
                    # a strided src (its peers may read it as plain bytes: copied first)
                    wide = np.repeat(sample(dtype, op, rank, count, seed=int(op)), 2)
                    out = np.zeros_like(wide[::2])
                    shm.allreduce(out, op, group, time.monotonic() + 10, algorithm=algorithm,
                                  src=wide[::2])
                    if not np.array_equal(out, want):
                        failures.append(f"strided src {np.dtype(dtype)} {op.name} "
                                        f"count={count} {algorithm}")
                    # out of place: read from src, write every element of a dirty buf
                    src = sample(dtype, op, rank, count, seed=int(op))
                    kept = src.copy()
                    out = np.full_like(src, not want[:1].any() if count else 0)
                    shm.allreduce(out, op, group, time.monotonic() + 10,
                                  algorithm=algorithm, src=src)
                    if not np.array_equal(out, want) or not np.array_equal(src, kept):
                        failures.append(f"src= {np.dtype(dtype)} {op.name} count={count} "
                                        f"{algorithm}")
    # random floats: not exactly NumPy's order, but bitwise the same on every rank
    digests = []
    for count, algorithm in ((5, "auto"), (1000, "auto"), (40_000, "reduce_scatter"),
                             (40_000, "cross_memory")):
        x = np.random.default_rng([7, rank, count]).standard_normal(count).astype(np.float32)
        shm.allreduce(x, ReduceOp.Sum, group, time.monotonic() + 10, algorithm=algorithm)
        ref = sum(np.random.default_rng([7, r, count]).standard_normal(count)
                  .astype(np.float32).astype(np.float64) for r in range(n))
        if not np.allclose(x, ref, rtol=1e-5, atol=1e-5):
            failures.append(f"random float32 count={count} {algorithm} differs from NumPy")
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
    # Sum is not defined on bool: a ValueError on every rank, and the group stays usable
    try:
        shm.allreduce(np.ones(3, bool), ReduceOp.Sum, group, time.monotonic() + 10)
        failures.append("bool Sum did not raise")
    except ValueError as exc:
        if "not defined on bool" not in str(exc):
            failures.append(f"bool Sum raised {exc!r}")
    ran = {a: shm.allreduce_algorithm(_shm_allreduce.ALLREDUCE_CMA_MIN, group, algorithm=a)
           for a in shm.ALLREDUCE_ALGORITHMS}
    ran["auto below"] = shm.allreduce_algorithm(_shm_allreduce.ALLREDUCE_CMA_MIN - 1, group)
    return failures, digests, ran


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_every_dtype_op_and_size_matches_numpy(n):
    """Every algorithm: one round, reduce-scatter through the segment, and reading the
    peers' memory (where the kernel lets siblings do it; else the segment's, as forced
    ones fall back to it)."""
    # (4 ranks on 2 CPUs beside the suite's other worker: 15-30 s)
    results = run_world(n, _allreduce_cases, slot_bytes=SLOT, timeout=90.0)
    for rank, (failures, _, _) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"
    assert len({tuple(d[:3]) for _, d, _ in results}) == 1, "ranks got different bits"
    assert len({d[3] for _, d, _ in results}) == 1, "ranks got different bits (cross-memory)"
    cma = siblings_can_cma()
    assert results[0][2] == {"auto": "cross_memory" if cma else "reduce_scatter",
                             "auto below": "reduce_scatter",
                             "one_round": "reduce_scatter",   # more than a slot
                             "reduce_scatter": "reduce_scatter",
                             "cross_memory": "cross_memory" if cma else "reduce_scatter"}


def _data_movement_cases(group):
    n, rank, failures = group.size, group.index, []
    dl = lambda: time.monotonic() + 10  # noqa: E731
    # allgatherv: zero-length blocks, odd sizes, and more than one bank in total
    for counts in ([0] * n, [0] * (n - 1) + [5], [r * 7 + 1 for r in range(n)],
                   [3 * SLOT + r for r in range(n)], [9 * n * SLOT if r == 1 else 0
                                                      for r in range(n)]):
        blocks = [np.random.default_rng([3, r, sum(counts)]).integers(0, 256, counts[r])
                  .astype(np.uint8) for r in range(n)]
        recv = np.full(sum(counts), 0xEE, np.uint8)
        shm.allgatherv(memoryview(blocks[rank]), memoryview(recv), counts, group, dl())
        if not np.array_equal(recv, np.concatenate(blocks)):
            failures.append(f"allgatherv counts={counts}")
    # broadcast from every root, one byte to several banks
    for root in range(n):
        for nbytes in (0, 1, n + 1, 2 * n * SLOT + 13):
            want = np.random.default_rng([5, root, nbytes]).integers(0, 256, nbytes,
                                                                      dtype=np.uint8)
            buf = want.copy() if rank == root else np.zeros(nbytes, np.uint8)
            shm.broadcast(buf, root, group, dl())
            if not np.array_equal(buf, want):
                failures.append(f"broadcast root={root} nbytes={nbytes}")
    # reducescatter with empty blocks and blocks that span chunks
    for counts in ([1] * n, [0] * (n - 1) + [n + 1], [700 * (r + 1) for r in range(n)],
                   [5000] + [0] * (n - 2) + [3]):   # a large block and a tiny one
        for dtype, op in ((np.float32, ReduceOp.Sum), (np.int16, ReduceOp.Max),
                          (ml_dtypes.bfloat16, ReduceOp.Product), (np.bool_, ReduceOp.Min)):
            total = sum(counts)
            x = sample(dtype, op, rank, total, seed=11)
            shm.reducescatter(x, counts, op, group, dl())
            start = sum(counts[:rank])
            want = expected(dtype, op, n, total, seed=11)[start:start + counts[rank]]
            if not np.array_equal(x[start:start + counts[rank]], want):
                failures.append(f"reducescatter {np.dtype(dtype)} counts={counts}")
            # the input read from src (left as it was), the block written into out, the
            # buffer not touched with both, or not there at all
            for with_src, with_out, no_buf in ((True, True, False), (True, False, False),
                                               (False, True, False), (True, True, True)):
                x = sample(dtype, op, rank, total, seed=11)
                before = x.copy()
                buf = np.zeros(total, dtype) if with_src else x
                out = np.zeros(counts[rank], dtype) if with_out else None
                shm.reducescatter(None if no_buf else buf, counts, op, group, dl(),
                                  src=x if with_src else None, out=out)
                got = out if with_out else buf[start:start + counts[rank]]
                if not np.array_equal(got, want) or (with_src and not np.array_equal(
                        x, before)) or (with_src and with_out and buf.any()):
                    failures.append(f"reducescatter {np.dtype(dtype)} counts={counts} "
                                    f"src={with_src} out={with_out}")
            if op == ReduceOp.Sum:   # each piece packed (here: negated) on its way
                x = sample(dtype, op, rank, total, seed=11)
                out = np.zeros(counts[rank], dtype)
                shm.reducescatter(None, counts, op, group, dl(), src=x, out=out,
                                  pack=lambda piece, dst: np.negative(piece, out=dst))
                if not np.array_equal(out, -want):
                    failures.append(f"reducescatter {np.dtype(dtype)} counts={counts} "
                                    f"packed on the way")
    # alltoallv: empty blocks, and blocks longer than a slot's part
    def block(src, to):
        size = ((src * 7 + to * 3) % 5) * 1500
        return np.random.default_rng([9, src, to]).integers(0, 256, size).astype(np.uint8)
    send = [block(rank, j) for j in range(n)]
    recv_blocks = [block(j, rank) for j in range(n)]
    recv = np.full(sum(b.size for b in recv_blocks), 0xEE, np.uint8)
    shm.alltoallv(np.concatenate(send), [b.size for b in send], recv,
                  [b.size for b in recv_blocks], group, dl())
    if not np.array_equal(recv, np.concatenate(recv_blocks)):
        failures.append("alltoallv")
    shm.barrier(group, dl())
    return failures


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgatherv_broadcast_reducescatter_alltoallv_barrier(n):
    for rank, failures in enumerate(run_world(n, _data_movement_cases, slot_bytes=SLOT)):
        assert failures == [], f"rank {rank}: {failures}"


def _broadcast_pieces_cases(group):
    """Broadcast in pieces smaller than a bank, the root reading from a separate ``src``
    (read-only here, so a write to it raises) or from ``buf``; a non-root's ``src`` is
    refused."""
    n, rank, failures = group.size, group.index, []
    dl = lambda: time.monotonic() + 10  # noqa: E731
    for root in range(n):
        for nbytes in (1, 70_000, 1_000_003, 3 * group.bank_bytes + 4097,
                       _shm_broadcast.BROADCAST_CMA_MIN + 3):
            want = np.random.default_rng([6, root, nbytes]).integers(0, 256, nbytes,
                                                                      dtype=np.uint8)
            want.flags.writeable = False
            for from_src in (True, False):
                buf = np.full(nbytes, 0xEE, np.uint8)
                if rank == root and not from_src:
                    buf[:] = want
                src = want if rank == root and from_src else None
                shm.broadcast(buf, root, group, dl(), src=src)
                if not np.array_equal(buf, want):
                    failures.append(f"broadcast root={root} nbytes={nbytes} src={from_src}")
    if rank != 0:
        try:
            shm.broadcast(np.zeros(4, np.uint8), 0, group, dl(), src=np.zeros(4, np.uint8))
            failures.append("a non-root's src was accepted")
        except ValueError as exc:
            if "only the root" not in str(exc):
                failures.append(f"unclear error: {exc}")
    shm.barrier(group, dl())
    return failures, group.cma


@pytest.mark.parametrize("n,cma", [(2, True), (3, True), (3, False)])
def test_broadcast_in_pieces_or_from_the_roots_memory(n, cma):
    """With cross-memory attach (the group's probe passes on this machine kind), sizes
    from BROADCAST_CMA_MIN on are read from the root's memory; without, in pieces."""
    assert _shm_broadcast.broadcast_piece_bytes(1 << 20, 4 << 20, 2, host_cpus=2) == 256 * 1024
    assert _shm_broadcast.broadcast_piece_bytes(1, 4 << 20, 2, host_cpus=2) == 64 * 1024
    assert _shm_broadcast.broadcast_piece_bytes(64 << 20, 1 << 20, 2, host_cpus=2) == 1 << 20
    assert _shm_broadcast.broadcast_piece_bytes(1 << 20, 4 << 20, 3, host_cpus=2) == 4 << 20
    want = cma and siblings_can_cma()   # where the kernel refuses, the pieces are tested
    for rank, (failures, agreed) in enumerate(run_world(n, _broadcast_pieces_cases,
                                                        slot_bytes=1 << 18, cma=cma)):
        assert failures == [], f"rank {rank}: {failures}"
        assert agreed is want, f"rank {rank}: cma={cma} gave ShmGroup.cma={agreed}"


def _read_only_receiver(group):
    buf = np.zeros(_shm_broadcast.BROADCAST_CMA_MIN, np.uint8)   # from the root's memory where cma
    if group.index == 1:
        buf.flags.writeable = False
    try:
        shm.broadcast(buf, 0, group, time.monotonic() + 10)
    except (ValueError, PeerLostError) as exc:
        return type(exc).__name__, str(exc), buf.any()
    return None, "no error", buf.any()


@pytest.mark.parametrize("cma", [True, False])
def test_a_read_only_receiving_buffer_fails_on_every_rank_and_stays_unwritten(cma):
    """The kernel's cross-memory read would write into it regardless: checked first."""
    (kind0, msg0, _), (kind1, msg1, written) = run_world(2, _read_only_receiver, cma=cma)
    assert kind1 == "ValueError" and "read-only" in msg1, msg1
    assert kind0 == "PeerLostError" and "read-only" in msg0, msg0
    assert not written


def _random_mix(group, steps):
    """The same seeded random sequence of mixed collectives on every rank: banks are
    reused across kinds (a broadcast round, then an allreduce round, ...)."""
    n, rank, failures = group.size, group.index, []
    plan = np.random.default_rng(1234)
    dl = lambda: time.monotonic() + 10  # noqa: E731
    for step in range(steps):
        kind = plan.integers(0, 5)
        count = int(plan.choice([0, 1, 7, 100, 1500, 5000]))
        root = int(plan.integers(0, n))
        data = np.random.default_rng([step, rank]).integers(-3, 4, count).astype(np.int32)
        everyone = [np.random.default_rng([step, r]).integers(-3, 4, count).astype(np.int32)
                    for r in range(n)]
        if kind == 0:
            algorithm = str(plan.choice(shm.ALLREDUCE_ALGORITHMS))
            shm.allreduce(data, ReduceOp.Sum, group, dl(), algorithm=algorithm)
            ok = np.array_equal(data, np.sum(everyone, axis=0, dtype=np.int32))
        elif kind == 1:
            shm.broadcast(data, root, group, dl())
            ok = np.array_equal(data, everyone[root])
        elif kind == 2:
            counts = [count * 4 if r != root else 0 for r in range(n)]
            recv = np.empty(sum(counts), np.uint8)
            shm.allgatherv(data.view(np.uint8) if rank != root else b"", recv, counts, group,
                           dl())
            ok = np.array_equal(recv, np.concatenate(
                [everyone[r].view(np.uint8) for r in range(n) if r != root] or
                [np.empty(0, np.uint8)]))
        elif kind == 3:
            counts = even_counts(count, n)
            shm.reducescatter(data, counts, ReduceOp.Max, group, dl())
            a = sum(counts[:rank])
            ok = np.array_equal(data[a:a + counts[rank]],
                                np.max(everyone, axis=0)[a:a + counts[rank]] if count else [])
        else:
            shm.barrier(group, dl())
            ok = True
        if not ok:
            failures.append(f"step {step} kind {kind} count {count} root {root}")
    return failures


def even_counts(total, parts):
    q, r = divmod(total, parts)
    return [q + (1 if k < r else 0) for k in range(parts)]


@pytest.mark.parametrize("n", [3])
def test_random_mix_of_collectives_shares_banks_safely(n):
    for rank, failures in enumerate(run_world(n, _random_mix, 300, slot_bytes=SLOT)):
        assert failures == [], f"rank {rank}: {failures}"


def _without_fence(group):
    from ddl.dataplane.transports import _futex
    _futex.HAVE_FENCE = False          # as on a machine without libatomic: always wake
    x = np.arange(100_000, dtype=np.int32) * (group.index + 1)
    for _ in range(3):
        shm.allreduce(x, ReduceOp.Max, group, time.monotonic() + 10, small_bytes=0)
        shm.barrier(group, time.monotonic() + 10)
    return x[-3:].tolist()


def test_without_a_fence_every_round_wakes_and_results_hold():
    n = 3
    for got in run_world(n, _without_fence, slot_bytes=SLOT):
        assert got == [(100_000 - k) * n for k in (3, 2, 1)]


def _mismatch(group):
    x = np.zeros(10 + 10 * group.index, np.float32)
    try:
        shm.allreduce(x, ReduceOp.Sum, group, time.monotonic() + 10)
    except (MismatchError, PeerLostError) as exc:
        first = exc
    else:
        return "no error"
    try:
        shm.barrier(group, time.monotonic() + 10)
    except BaseException as exc:  # noqa: BLE001
        again = exc
    return type(first).__name__, str(first), again is first


def _broadcast_size_mismatch(group, theirs):
    """Root 0 sends 1 MiB (read from its memory where the group allows it); rank 1
    expects ``theirs`` bytes."""
    nbytes = 1 << 20 if group.index == 0 else theirs
    try:
        shm.broadcast(np.zeros(nbytes, np.uint8), 0, group, time.monotonic() + 10)
    except (MismatchError, PeerLostError) as exc:
        return type(exc).__name__, str(exc)
    return None, "no error"


@pytest.mark.parametrize("theirs", [1 << 20 | 1, 100])
def test_broadcasts_of_different_sizes_fail_on_both_ranks(theirs):
    for rank, (kind, message) in enumerate(run_world(2, _broadcast_size_mismatch, theirs)):
        assert kind in ("MismatchError", "PeerLostError"), (rank, kind, message)
        assert "broadcast(1048576 bytes, root 0)" in message, message
        assert f"broadcast({theirs} bytes, root 0)" in message, message


def test_mismatched_calls_raise_mismatch_error_naming_both_ranks():
    for rank, out in enumerate(run_world(2, _mismatch)):
        kind, message, sticky = out
        assert kind == "MismatchError", out
        assert "local rank 0 (" in message and "local rank 1 (" in message, message
        assert "allreduce/one_round(40 bytes of float32, op Sum)" in message, message
        assert "allreduce/one_round(80 bytes of float32, op Sum)" in message, message
        assert sticky, "a broken group must raise the same error again"


def _algorithm_mismatch(group):
    algorithm = ("cross_memory", "reduce_scatter")[group.index]
    try:
        shm.allreduce(np.zeros(4000, np.float32), ReduceOp.Sum, group,
                      time.monotonic() + 10, algorithm=algorithm)
    except (MismatchError, PeerLostError) as exc:
        return type(exc).__name__, str(exc)
    return None, "no error"


def test_the_setting_offers_exactly_the_algorithms_allreduce_runs():
    from ddl.core.config import var
    assert var("shm_allreduce_algorithm").choices == shm.ALLREDUCE_ALGORITHMS


def test_ranks_that_chose_different_algorithms_raise_mismatch_error():
    """A setting that differs between the ranks (DDL_SHM_ALLREDUCE_ALGORITHM): the chosen
    algorithm is part of the call's descriptor, so no rank reads the other's bytes as
    addresses."""
    if not siblings_can_cma():
        pytest.skip("this kernel does not let sibling processes read each other's memory: "
                    "cross_memory falls back to reduce_scatter, so both ranks agree")
    for rank, (kind, message) in enumerate(run_world(2, _algorithm_mismatch)):
        assert kind in ("MismatchError", "PeerLostError"), (rank, kind, message)
        assert "allreduce/cross_memory(16000 bytes of float32, op Sum)" in message, message
        assert "allreduce(16000 bytes of float32, op Sum)" in message, message


def _alltoall_mismatch(group):
    send_counts, recv_counts = ([2, 4], [2, 5]) if group.index == 0 else ([3, 1], [4, 1])
    send = np.zeros(sum(send_counts), np.uint8)
    recv = np.zeros(sum(recv_counts), np.uint8)
    try:
        shm.alltoallv(send, send_counts, recv, recv_counts, group, time.monotonic() + 10)
    except (MismatchError, PeerLostError) as exc:
        return type(exc).__name__, str(exc)
    return None, "no error"


def test_alltoallv_counts_that_do_not_pair_up_raise_instead_of_hanging():
    (kind0, msg0), (kind1, msg1) = run_world(2, _alltoall_mismatch)
    expected = "local rank 1 sends 3 bytes to local rank 0, which expects 5"
    assert kind0 == "MismatchError" and expected in msg0, msg0
    assert kind1 == "MismatchError" and msg1 == msg0, msg1   # every rank sees every pair


def _use_after_close(group):
    group.close()
    group.close()   # idempotent
    try:
        shm.barrier(group, time.monotonic() + 1)
    except ShutdownError as exc:
        return str(exc)
    return "no error"


def test_close_is_idempotent_and_later_calls_raise_shutdown_error():
    for message in run_world(2, _use_after_close):
        assert "the group is closed" in message


def test_a_group_of_one_needs_no_segment():
    g = ShmGroup(secrets.token_hex(8), os.urandom(32), HOST, 0, 1).connect(time.monotonic() + 1)
    x = np.arange(5, dtype=np.int32)
    shm.allreduce(x, ReduceOp.Sum, g, time.monotonic() + 1)
    recv = np.empty(3, np.uint8)
    shm.allgatherv(np.arange(3, dtype=np.uint8), recv, [3], g, time.monotonic() + 1)
    shm.broadcast(x, 0, g, time.monotonic() + 1)
    y = np.zeros(5, np.int32)
    shm.broadcast(y, 0, g, time.monotonic() + 1, src=x)
    shm.barrier(g, time.monotonic() + 1)
    g.close()
    assert x.tolist() == [0, 1, 2, 3, 4] and recv.tolist() == [0, 1, 2]
    assert y.tolist() == x.tolist()
    assert leftover_segments(g.job_id) == []


def test_reducescatter_pieces_fit_a_slot_and_cover_every_block():
    """The pieces of each round: in proportion to the blocks, together within the slot,
    one at least for a block that has any, and enough rounds for the longest; an even
    split of a slot's worth takes no extra round."""
    import random
    from ddl.dataplane.algorithms._shm_reducescatter import _pieces
    rng = random.Random(7)
    for _ in range(20000):
        n = rng.randint(1, 9)
        room = rng.choice([2 * n, 2 * n + 1, 512, 1024, 262144])
        counts = [rng.choice([0, 1, 2, rng.randint(0, 10 ** 6)]) for _ in range(n)]
        if not sum(counts):
            continue
        pieces, rounds = _pieces(counts, room)
        assert sum(pieces) <= room, (counts, room, pieces)
        assert all((c == 0) == (p == 0) for c, p in zip(counts, pieces)), (counts, pieces)
        assert all(p * rounds >= c for c, p in zip(counts, pieces)), (counts, pieces, rounds)
    assert _pieces([262144, 262144], 262144) == ([131072, 131072], 2)
    assert _pieces([4194304, 0], 262144) == ([262144, 0], 16)   # a skewed split
    with pytest.raises(ValueError, match="cannot carry"):
        _pieces([1, 1, 1], 5)
