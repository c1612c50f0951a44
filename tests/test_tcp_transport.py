"""TcpTransport handshake, failure and deadline behaviour over real loopback sockets."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from test_tcp_world import JOB_ID, SECRET, close_world, make_world, run_threads

from ddl.core.errors import DDLTimeoutError, HandshakeError, PeerLostError, ShutdownError
from ddl.dataplane.transports import _handshake, _tcp_accept
from ddl.dataplane.transports.tcp import TcpTransport
from ddl.launcher._probe import local_addresses

pytestmark = pytest.mark.timeout(30)
LOGGER = "ddl.dataplane.transports.tcp"


@pytest.fixture
def world():
    w = make_world(3, poll_interval=0.05)
    yield w
    close_world(w)


def addresses(world):
    return {r: t._peers[r] for r, t in enumerate(world)}


def exchange(world, a, b, nbytes=100_000):
    """``a`` sends ``nbytes`` to ``b``; returns what ``b`` received."""
    data = np.arange(nbytes, dtype=np.uint8)
    got = np.zeros_like(data)

    def fn(r):
        if r == a:
            world[a].send(b, memoryview(data), time.monotonic() + 5)
        else:
            world[b].recv_into(a, memoryview(got), time.monotonic() + 5)

    run_threads(2, fn, timeout=10, ranks=[a, b])
    np.testing.assert_array_equal(got, data)


def assert_closed_by_server(sock):
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:       # closed with our unread bytes in its buffer
        pass


def wait_for(cond, timeout=3.0):
    stop = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < stop, "condition not reached"
        time.sleep(0.01)


# -- handshake ------------------------------------------------------------------------------
def test_wrong_secret_is_refused_on_both_sides_and_listener_keeps_serving(world, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    impostor = TcpTransport(0, 3, b"x" * 32, JOB_ID)
    impostor.set_peers(addresses(world))
    try:
        with pytest.raises(HandshakeError, match=r"rank 2 \(127\.0\.0\.1:\d+\) refused the proof "
                                                 r"of rank 0 .*different DDL_JOB_SECRET") as ei:
            impostor.send(2, memoryview(b"hello"), time.monotonic() + 5)
        assert ei.value.peer == world[2]._peers[2]
    finally:
        impostor.close()
    wait_for(lambda: any("refused data-plane connection from 127.0.0.1:" in r.getMessage()
                         for r in caplog.records))
    exchange(world, 0, 2)
    exchange(world, 1, 2)


def test_wrong_job_id_is_refused(world, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    other = TcpTransport(0, 3, SECRET, "ffffffffffffffff")
    other.set_peers(addresses(world))
    try:
        with pytest.raises(HandshakeError, match="refused the data-plane handshake from rank 0"):
            other.send(1, memoryview(b"x"), time.monotonic() + 5)
    finally:
        other.close()
    wait_for(lambda: any("belongs to job ffffffffffffffff" in r.getMessage()
                         for r in caplog.records))
    exchange(world, 0, 1)


def test_garbage_header_is_dropped(world, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    host, port = world[1]._peers[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n" + b"\0" * 100)
        assert_closed_by_server(s)          # the server closed without answering
    wait_for(lambda: any("bad magic" in r.getMessage() for r in caplog.records))
    exchange(world, 0, 1)


def test_false_rank_claim_is_refused(world):
    liar = TcpTransport(2, 3, SECRET, JOB_ID)  # rank 2 must never dial rank 1
    liar.set_peers(addresses(world))
    try:
        with pytest.raises(HandshakeError, match="refused"):
            liar._dial(1, time.monotonic() + 5)
    finally:
        liar.close()


def test_silent_client_does_not_block_others_and_is_dropped(world, monkeypatch):
    monkeypatch.setattr(_tcp_accept, "HANDSHAKE_TIMEOUT", 1.5)
    host, port = world[2]._peers[2].rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)
    try:
        wait_for(lambda: world[2].pending_handshakes() == 1)   # its handshake is pending...
        exchange(world, 0, 2)
        exchange(world, 1, 2)
        assert world[2].pending_handshakes() == 1              # ...while others got through
        silent.settimeout(5)
        assert_closed_by_server(silent)            # dropped at the handshake deadline
        wait_for(lambda: world[2].pending_handshakes() == 0)
    finally:
        silent.close()


def _header(job_id=JOB_ID, rank=0):
    return _handshake.HEADER.pack(_handshake.MAGIC, _handshake.VERSION, rank,
                                  _handshake.job_id_bytes(job_id), os.urandom(32))


def _read_to_end(sock, timeout=5.0):
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got


def test_a_header_of_this_job_without_a_proof_gets_a_nonce_and_no_proof(world, monkeypatch):
    """The job id is not secret: a listener answers it with a fresh nonce only, and
    proves nothing before the client has; the connection is closed at the deadline."""
    monkeypatch.setattr(_tcp_accept, "HANDSHAKE_TIMEOUT", 1.0)
    host, port = world[2]._peers[2].rsplit(":", 1)
    replies = []
    for _ in range(2):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(_header())
            t0 = time.monotonic()
            replies.append(_read_to_end(s))
            assert time.monotonic() - t0 < 3 * 1.0
    assert [len(r) for r in replies] == [_handshake.NONCE_BYTES] * 2, replies
    assert replies[0] != replies[1]  # fresh each time
    exchange(world, 0, 2)


def test_the_client_checks_the_servers_proof():
    ls = socket.create_server(("127.0.0.1", 0))

    def impostor():  # knows the protocol, not the secret
        conn, _ = ls.accept()
        with conn:
            conn.recv(_handshake.HEADER.size)
            conn.sendall(os.urandom(_handshake.NONCE_BYTES))
            conn.recv(_handshake.MAC_BYTES)
            conn.sendall(os.urandom(_handshake.MAC_BYTES))
            conn.recv(1)

    threading.Thread(target=impostor, daemon=True).start()
    t = TcpTransport(0, 2, SECRET, JOB_ID)
    t.set_peers({1: f"127.0.0.1:{ls.getsockname()[1]}"})
    try:
        with pytest.raises(HandshakeError, match=r"rank 1 \(127\.0\.0\.1:\d+\) failed to prove "
                                                 r"it knows the job secret"):
            t.send(1, memoryview(b"x"), time.monotonic() + 5)
    finally:
        t.close()
        ls.close()


def test_a_full_listener_evicts_the_oldest_silent_connection_never_a_rank(world, caplog):
    """Connections that sent this job's header stay; the oldest silent ones give way to
    newer ones; a rank's connection gets through at once."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    world[2]._max_pending = 8
    host, port = world[2]._peers[2].rsplit(":", 1)
    started, silent = [], []
    try:
        for _ in range(6):
            started.append(socket.create_connection((host, int(port)), timeout=5))
            started[-1].sendall(_header())
            started[-1].recv(_handshake.NONCE_BYTES, socket.MSG_WAITALL)
        for _ in range(20):
            silent.append(socket.create_connection((host, int(port)), timeout=5))
        wait_for(lambda: world[2].pending_handshakes() == 8)
        exchange(world, 0, 2)
        exchange(world, 1, 2)
        for s in silent[:-2]:
            assert_closed_by_server(s)
        for s in started + silent[-1:]:  # still waiting
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        first = f"127.0.0.1:{silent[0].getsockname()[1]}"
        wait_for(lambda: any(f"closed the unauthenticated connection from {first}: 8 "
                             f"connections are waiting for a handshake; the oldest gives "
                             f"way" in r.getMessage() for r in caplog.records))
    finally:
        for s in started + silent:
            s.close()


def test_one_remote_address_holds_only_its_share_of_pending_connections():
    remote = [a for a in local_addresses()]
    if not remote:
        pytest.skip("this host has no non-loopback IPv4 address")
    t = TcpTransport(1, 2, SECRET, JOB_ID, bind_address="0.0.0.0")
    socks = []
    try:
        port = int(t.listen().rsplit(":", 1)[1])
        t._max_pending = 16  # a share of 2 per remote address
        for _ in range(5):
            s = socket.socket()
            s.bind((remote[0], 0))
            s.connect((remote[0], port))
            socks.append(s)
        for _ in range(3):  # loopback: every local process, ranks included; no share
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda: t.pending_handshakes() == 5)
        for s in socks[:3]:
            assert_closed_by_server(s)
    finally:
        for s in socks:
            s.close()
        t.close()


def test_warnings_are_rate_limited(world, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    host, port = world[1]._peers[1].rsplit(":", 1)
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"\1" * 50)
            assert_closed_by_server(s)
    time.sleep(0.1)
    assert sum("bad magic" in r.getMessage() for r in caplog.records) == 1


# -- failures ---------------------------------------------------------------------------------
def test_peer_closing_mid_sendrecv_raises_peer_lost_naming_it():
    world = make_world(2, poll_interval=0.05)
    try:
        run_threads(2, lambda r: world[r].connect_all([0, 1], time.monotonic() + 5))
        big = np.zeros(64 << 20, dtype=np.uint8)
        into = np.empty_like(big)
        closed_at = []

        def closer():
            time.sleep(0.3)
            closed_at.append(time.monotonic())
            world[1].close()

        threading.Thread(target=closer, daemon=True).start()
        with pytest.raises(PeerLostError) as ei:
            world[0].sendrecv(1, memoryview(big), 1, memoryview(into), time.monotonic() + 20)
        assert time.monotonic() - closed_at[0] < 2.0
        err = ei.value
        assert err.rank == 1
        assert f"rank 1 ({world[0]._peers[1]}) closed the data-plane connection during sendrecv" \
            in str(err)
        with pytest.raises(PeerLostError) as again:   # sticky for that peer
            world[0].send(1, memoryview(b"x"), time.monotonic() + 5)
        assert again.value is err
    finally:
        close_world(world)


def test_higher_rank_sees_lower_rank_vanish():
    world = make_world(2, poll_interval=0.05)
    try:
        run_threads(2, lambda r: world[r].connect_all([0, 1], time.monotonic() + 5))
        threading.Timer(0.2, world[0].close).start()
        buf = bytearray(10)
        with pytest.raises(PeerLostError, match=r"rank 0 \(127\.0\.0\.1:\d+\) closed") as ei:
            world[1].recv_into(0, memoryview(buf), time.monotonic() + 10)
        assert ei.value.rank == 0
    finally:
        close_world(world)


def test_deadline_raises_timeout_with_byte_counts():
    world = make_world(2, poll_interval=0.05)
    try:
        t0 = time.monotonic()
        with pytest.raises(DDLTimeoutError,
                           match=r"received 0 of 100 bytes from rank 1 \(127\.0\.0\.1:\d+\)"):
            world[0].recv_into(1, memoryview(bytearray(100)), time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - t0 < 1.0
    finally:
        close_world(world)


def test_waiting_for_a_peer_that_never_dials_times_out():
    world = make_world(2, poll_interval=0.05)
    try:
        with pytest.raises(DDLTimeoutError, match="rank 0 .* did not connect"):
            world[1].recv_into(0, memoryview(bytearray(1)), time.monotonic() + 0.3)
    finally:
        close_world(world)


def test_unreachable_peer_times_out_naming_it():
    t = TcpTransport(0, 2, SECRET, JOB_ID, connect_timeout=0.4, poll_interval=0.05)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()                                  # nothing listens there now
    t.set_peers({1: dead})
    try:
        with pytest.raises(DDLTimeoutError, match=f"could not connect to rank 1 at {dead}"):
            t.send(1, memoryview(b"x"), time.monotonic() + 10)
    finally:
        t.close()


def test_abort_check_interrupts_blocked_recv_within_poll_interval():
    abort = threading.Event()

    class Aborted(Exception):
        pass

    def check():
        if abort.is_set():
            raise Aborted("job failed elsewhere")

    t0 = TcpTransport(0, 2, SECRET, JOB_ID, abort_check=check, poll_interval=0.1)
    t1 = TcpTransport(1, 2, SECRET, JOB_ID, poll_interval=0.1)
    peers = {0: t0.listen(), 1: t1.listen()}
    t0.set_peers(peers)
    t1.set_peers(peers)
    try:
        def trigger():
            time.sleep(0.3)
            abort.set()
            fired.append(time.monotonic())

        fired = []
        threading.Thread(target=trigger, daemon=True).start()
        with pytest.raises(Aborted):
            t0.recv_into(1, memoryview(bytearray(10)), time.monotonic() + 10)
        assert time.monotonic() - fired[0] < 0.1 + 0.15
    finally:
        t0.close()
        t1.close()


def test_close_is_idempotent_and_later_calls_raise_shutdown(world):
    world[0].close()
    world[0].close()
    with pytest.raises(ShutdownError, match="transport is closed"):
        world[0].send(1, memoryview(b"x"), time.monotonic() + 1)


@pytest.mark.timeout(30)
def test_close_stops_the_acceptor_and_leaves_no_descriptor():
    """close() wakes the acceptor (it does not wait out its poll interval: a poll interval
    of an hour would hang here) and closes every socket it opened."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        t = TcpTransport(0, 2, b"k" * 32, "job", poll_interval=3600.0)
        t.listen()
        t.close()
        assert not t._acceptor.is_alive()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_listen_that_fails_leaves_no_descriptor(monkeypatch):
    def no_name(_host):
        raise socket.gaierror("no address for this host")
    monkeypatch.setattr(socket, "gethostbyname", no_name)
    before = len(os.listdir("/proc/self/fd"))
    t = TcpTransport(0, 2, b"k" * 32, "job", bind_address="0.0.0.0")
    with pytest.raises(socket.gaierror):
        t.listen()
    t.close()
    assert len(os.listdir("/proc/self/fd")) == before


LOW_FD_SERVER = r"""
import os, resource, sys, time
from ddl.dataplane.transports.tcp import TcpTransport
limit = len(os.listdir("/proc/self/fd")) + 40  # fewer than the smallest pending cap (64)
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
t = TcpTransport(1, 2, bytes(range(32)), "00112233aabbccdd", poll_interval=0.05)
print(t.listen(), flush=True)
t.recv_into(0, memoryview(bytearray(5)), time.monotonic() + 60)
print("got it", flush=True)
t.close()
"""


def test_a_listener_out_of_descriptors_lets_the_oldest_pending_connection_go():
    """A process whose descriptor limit is below the pending cap: a flood takes its last
    descriptor, and the rank's connection still gets through (the oldest pending one
    gives way)."""
    proc = subprocess.Popen([sys.executable, "-c", LOW_FD_SERVER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    idle = []
    t = TcpTransport(0, 2, SECRET, JOB_ID)
    try:
        address = proc.stdout.readline().strip()
        host, port = address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(100)]
        t.set_peers({1: address})
        t.send(1, memoryview(b"hello"), time.monotonic() + 30)
        assert proc.stdout.readline().strip() == "got it"
        assert proc.wait(10) == 0
    finally:
        t.close()
        for s in idle:
            s.close()
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert re.search(r"closed the unauthenticated connection from 127\.0\.0\.1:\d+: this "
                     r"process ran out of file descriptors \(\[Errno 24\] Too many open "
                     r"files\); the oldest pending connection gives way", err), err
