"""Shared-memory groups when things go wrong: dead, stopped and aborting peers; segment
names, permissions and cleanup.

Worlds of processes come from :mod:`test_shm_collectives`; the segment tests run a rank
or two on threads of this process (futex waits release the GIL).
"""

from __future__ import annotations

import os
import secrets
import signal
import stat
import threading
import time

import numpy as np
import pytest
from test_shm_collectives import HOST, World, leftover_segments, run_world, siblings_can_cma

from ddl.core.dtypes import ReduceOp
from ddl.core.errors import DDLTimeoutError
from ddl.dataplane.algorithms import shm_collectives as shm
from ddl.dataplane.transports.shm import (SharedMemoryError, ShmGroup, available,
                                          cleanup_job_segments, segment_name, segment_prefix)

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not available(), reason="needs Linux futexes and /dev/shm")]


class AbortAfter:
    """An ``abort_check`` that starts failing ``seconds`` after its first call."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.start = None

    def __call__(self):
        now = time.monotonic()
        self.start = self.start or now
        if now - self.start >= self.seconds:
            raise RuntimeError("the job failed elsewhere")


class KillSelf:
    """An ``abort_check`` that SIGKILLs its own process: a crash inside a wait."""

    def __call__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


# -- peers that die, stop, abort or leave ----------------------------------------------------
def _allreduce_until_killed(group, algorithm):
    if group.index == group.size - 1:     # the victim: SIGKILL while collectives run
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    x = np.ones(1 << 20, np.float32)
    ran = shm.allreduce_algorithm(x.nbytes, group, algorithm=algorithm)

    def loop():
        while True:
            shm.allreduce(x, ReduceOp.Max, group, time.monotonic() + 30, algorithm=algorithm)
    return ran, _outcome(loop)


@pytest.mark.parametrize("n,algorithm", [(2, "reduce_scatter"), (3, "reduce_scatter"),
                                         (3, "cross_memory")])
def test_kill_9_mid_collective_makes_the_others_raise_peer_lost_within_a_second(n, algorithm):
    """Through the segment, or reading the peers' memory (where the kernel allows)."""
    world = World(n, _allreduce_until_killed, algorithm, slot_bytes=1 << 16)
    results = world.collect(timeout=20, ranks=range(n - 1))
    want = algorithm if algorithm != "cross_memory" or siblings_can_cma() else "reduce_scatter"
    for rank, (ran, (kind, message, elapsed)) in enumerate(results):
        assert ran == want, (rank, ran)
        assert kind == "PeerLostError", (rank, kind, message)
        assert f"local rank {n - 1} (" in message and "died" in message, message
        assert elapsed < 3.0, f"rank {rank} took {elapsed:.2f} s (deadline was 30 s)"
    assert leftover_segments(world.job_id) == []


def _broadcast_until_killed(group, victim):
    """16 MiB broadcasts from local rank 0 (read from its memory) until ``victim``
    (the root, or a reader) is SIGKILLed."""
    if group.index == victim:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    x = np.ones(16 << 20, np.uint8)

    def loop():
        while True:
            shm.broadcast(x, 0, group, time.monotonic() + 30)
    return group.cma, _outcome(loop)


@pytest.mark.parametrize("victim", [0, 2])
def test_kill_9_during_a_broadcast_from_the_roots_memory_is_reported(victim):
    if not siblings_can_cma():
        pytest.skip("this kernel does not let sibling processes read each other's memory "
                    "(Yama ptrace_scope or a container): no cross-memory broadcast to kill")
    world = World(3, _broadcast_until_killed, victim)
    survivors = [r for r in range(3) if r != victim]
    for rank, (cma, (kind, message, elapsed)) in zip(survivors,
                                                      world.collect(timeout=20,
                                                                    ranks=survivors)):
        assert cma, "the group did not agree on cross-memory attach"
        assert kind == "PeerLostError", (rank, kind, message)
        # the one that saw it die says so; the others learn it from that one
        assert f"local rank {victim} (" in message, message
        assert elapsed < 3.0, f"rank {rank} took {elapsed:.2f} s (deadline was 30 s)"
    assert leftover_segments(world.job_id) == []


def _wait_for_stopped_peer(group):
    if group.index == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    time.sleep(0.2)
    return _outcome(lambda: shm.allreduce(np.ones(4, np.int64), ReduceOp.Sum, group,
                                          time.monotonic() + 0.5))


def test_a_stopped_peer_ends_with_the_deadline():
    world = World(2, _wait_for_stopped_peer)
    (kind, message, elapsed), = world.collect(timeout=20, ranks=[0])
    assert kind == "DDLTimeoutError", message
    assert "passed its deadline" in message and "local rank 1 (" in message, message
    assert 0.5 <= elapsed < 1.5


def _abort_while_peer_is_late(group):
    if group.index == 0:   # waits for rank 1 until its abort_check fires
        return _outcome(lambda: shm.barrier(group, time.monotonic() + 30))
    time.sleep(0.6)   # arrives after rank 0 gave up
    return _outcome(lambda: shm.barrier(group, time.monotonic() + 30))


def test_abort_check_interrupts_a_wait_and_peers_learn_why():
    world = World(2, _abort_while_peer_is_late, abort_check=AbortAfter(0.3))
    (kind0, msg0, t0), (kind1, msg1, _) = world.collect(timeout=20)
    assert (kind0, msg0) == ("RuntimeError", "the job failed elsewhere")
    assert t0 < 0.3 + 0.5, f"abort_check ran too late: {t0:.2f} s"
    assert kind1 == "PeerLostError"
    assert "local rank 0 (" in msg1 and "the job failed elsewhere" in msg1, msg1


def _leave_early(group):
    if group.index == 1:
        return None
    time.sleep(0.2)
    return _outcome(lambda: shm.barrier(group, time.monotonic() + 30))


def test_a_peer_that_closes_the_group_is_reported_at_once():
    kind, message, elapsed = run_world(2, _leave_early)[0]
    assert kind == "PeerLostError" and "closed the group" in message, message
    assert elapsed < 1.0


class Leaving:
    """An ``abort_check`` that raises once its process is leaving (``Leaving.now``), as
    the engine's does once ddl is shut down."""

    now = False

    def __call__(self):
        if Leaving.now:
            raise RuntimeError("ddl was shut down")


def _last_round_late_peer(group):
    Leaving.now = True
    if group.index == 1:
        time.sleep(0.4)
    return _outcome(lambda: (None if group.last_round(time.monotonic() + 10, "close")
                             else shm.barrier(group, 0)))


def test_the_last_round_waits_for_a_late_peer_without_the_process_abort_check():
    """Members leaving (their abort check raises): the last round waits for the late
    one and succeeds on both."""
    world = World(2, _last_round_late_peer, abort_check=Leaving())
    (kind0, msg0, t0), (kind1, msg1, _) = world.collect(timeout=20)
    assert (kind0, kind1) == (None, None), (msg0, msg1)
    assert 0.3 <= t0 < 2.0, t0


def _last_round_after_peer_left(group):
    if group.index == 1:
        return None   # leaves without a last round: its group closes
    time.sleep(0.2)
    start = time.monotonic()
    done = group.last_round(start + 10, "close")
    return done, time.monotonic() - start


def test_the_last_round_gives_up_at_once_on_a_peer_that_left():
    done, elapsed = run_world(2, _last_round_after_peer_left)[0]
    assert done is False and elapsed < 1.0, (done, elapsed)


# -- segments: names, permissions, cleanup ---------------------------------------------------
def test_segment_names_carry_128_secret_bits_and_a_job_prefix():
    secret, job = os.urandom(32), secrets.token_hex(8)
    name = segment_name(secret, job, "host-a")
    assert name.startswith(f"ddl-{job}-") and len(name) == len(f"ddl-{job}-") + 32
    int(name[-32:], 16)
    assert segment_name(secret, job, "host-a") == name
    others = {segment_name(os.urandom(32), job, "host-a"), segment_name(secret, job, "host-b"),
              segment_name(secret, job, "host-a", tag="ps1"), name}
    assert len(others) == 4
    assert segment_prefix("not/a plain id") == segment_prefix("not/a plain id")
    assert "/" not in segment_prefix("not/a plain id")


def _connect_in_thread(group, deadline):
    box = {}

    def body():
        try:
            group.connect(deadline)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


def test_created_segment_is_0600_and_removed_when_the_rendezvous_fails():
    g = ShmGroup(secrets.token_hex(8), os.urandom(32), HOST, 0, 2, spin_us=0)
    t, box = _connect_in_thread(g, time.monotonic() + 0.8)
    stop = time.monotonic() + 5
    while not os.path.exists(g.path):
        assert time.monotonic() < stop
        time.sleep(0.01)
    st = os.stat(g.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    t.join(10)
    assert isinstance(box["error"], DDLTimeoutError)
    assert "local ranks [1] of 2 did not attach" in str(box["error"])
    assert not os.path.exists(g.path)


def test_an_existing_name_is_never_reused_or_clobbered():
    g = ShmGroup(secrets.token_hex(8), os.urandom(32), HOST, 0, 2)
    with open(g.path, "xb") as f:
        f.write(b"somebody else's")
    try:
        with pytest.raises(SharedMemoryError, match="already exists.*cleanup_job_segments"):
            g.connect(time.monotonic() + 1)
        with open(g.path, "rb") as f:
            assert f.read() == b"somebody else's"
    finally:
        os.unlink(g.path)


def test_attach_refuses_a_segment_others_can_read():
    job, secret = secrets.token_hex(8), os.urandom(32)
    g = ShmGroup(job, secret, HOST, 1, 2)
    fd = os.open(g.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.ftruncate(fd, g.segment_bytes)
        with pytest.raises(SharedMemoryError, match="refusing .*mode -rw-r--r--"):
            g.connect(time.monotonic() + 1)
    finally:
        os.close(fd)
        if os.path.exists(g.path):
            os.unlink(g.path)


def test_attach_refuses_a_header_not_made_with_the_job_secret():
    import struct

    from ddl.dataplane.transports import _shm_layout
    g = ShmGroup(secrets.token_hex(8), os.urandom(32), HOST, 1, 2)
    fd = os.open(g.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, g.segment_bytes)
        os.pwrite(fd, struct.pack("<4Q", _shm_layout._MAGIC, 1, 2, 2 * g.bank_bytes), 0)
        with pytest.raises(SharedMemoryError, match="not made with this job's secret"):
            g.connect(time.monotonic() + 1)
    finally:
        os.close(fd)
        if os.path.exists(g.path):
            os.unlink(g.path)


def test_ranks_that_disagree_on_the_slot_size_fail_clearly():
    job, secret = secrets.token_hex(8), os.urandom(32)
    g0 = ShmGroup(job, secret, HOST, 0, 2, slot_bytes=4096, spin_us=0)
    g1 = ShmGroup(job, secret, HOST, 1, 2, slot_bytes=8192, spin_us=0)
    t, box = _connect_in_thread(g0, time.monotonic() + 1.0)
    with pytest.raises(SharedMemoryError, match="local ranks disagree on the group"):
        g1.connect(time.monotonic() + 5)
    t.join(10)
    assert isinstance(box["error"], DDLTimeoutError)
    assert leftover_segments(job) == []


def test_threads_of_one_process_can_form_a_group():
    job, secret = secrets.token_hex(8), os.urandom(32)
    groups = [ShmGroup(job, secret, HOST, r, 2, spin_us=0) for r in range(2)]
    threads = [_connect_in_thread(g, time.monotonic() + 5) for g in groups]
    for t, box in threads:
        t.join(10)
        assert "error" not in box, box
    assert leftover_segments(job) == []   # unlinked as soon as both attached
    out = [np.arange(6, dtype=np.float64) * (r + 1) for r in range(2)]
    workers = [threading.Thread(target=shm.allreduce,
                                args=(out[r], ReduceOp.Sum, groups[r], time.monotonic() + 5))
               for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    for g in groups:
        g.close()
    assert out[0].tolist() == out[1].tolist() == (np.arange(6) * 3.0).tolist()


def _connected_pair(cma):
    """Two ranks of one group on threads of this process, connected; ``cma``: each one's."""
    job, secret = secrets.token_hex(8), os.urandom(32)
    groups = [ShmGroup(job, secret, HOST, r, 2, spin_us=0, cma=c) for r, c in enumerate(cma)]
    threads = [_connect_in_thread(g, time.monotonic() + 5) for g in groups]
    for t, box in threads:
        t.join(10)
        assert "error" not in box, box
    return groups


@pytest.mark.parametrize("wanted,agreed", [((True, True), True), ((True, False), False)])
def test_cross_memory_attach_is_used_only_when_every_rank_can_and_wants(wanted, agreed):
    """The probe at connect: each rank reads every peer's token; one rank that cannot
    (or, here, passes cma=False as DDL_SHM_CMA=off does) turns it off for the group."""
    groups = _connected_pair(wanted)
    try:
        assert [g.cma for g in groups] == [agreed, agreed]
    finally:
        for g in groups:
            g.close()


def test_a_refused_cross_memory_read_turns_it_off_for_the_group(monkeypatch):
    """As under Yama's ptrace_scope 1: process_vm_readv fails with EPERM."""
    import errno

    from ddl.dataplane.transports import _cma

    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(_cma, "read", refuse)
    groups = _connected_pair((True, True))
    try:
        assert [g.cma for g in groups] == [False, False]
        out = [np.full(1 << 20, r, np.uint8) for r in range(2)]   # the segment path
        workers = [threading.Thread(target=shm.broadcast, args=(out[r], 0, groups[r],
                                                                time.monotonic() + 5))
                   for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(10)
        assert not out[1].any()
    finally:
        for g in groups:
            g.close()


def test_a_crash_during_the_rendezvous_leaves_a_name_that_cleanup_removes():
    world = World(2, _allreduce_until_killed, "auto", start=[0], abort_check=KillSelf())
    proc = world.procs[0]
    proc.wait(timeout=20)
    assert proc.returncode == -signal.SIGKILL
    left = leftover_segments(world.job_id)
    assert len(left) == 1
    assert cleanup_job_segments(world.job_id) == left
    assert leftover_segments(world.job_id) == []
    assert cleanup_job_segments(world.job_id) == []
    world.stop()


def test_cleanup_touches_only_this_jobs_segment_names(tmp_path):
    job = secrets.token_hex(8)
    mine = segment_name(os.urandom(32), job, HOST)
    names = [mine, f"ddl-{job}-notsixteenbytesofhex", segment_name(os.urandom(32), "other", HOST),
             "unrelated"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert cleanup_job_segments(job, shm_dir=str(tmp_path)) == [mine]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
