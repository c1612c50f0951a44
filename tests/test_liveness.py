"""Liveness: HTTP/2 keepalive on every control connection, heartbeats on idle streams.

Keepalive (ddl/core/keepalive.py): a real CoordinatorServer and a real ControlClient, one of
them in a child process that is stopped (SIGSTOP: the other side must lose it within the
keepalive interval + timeout) or that holds the GIL in a C call for three keepalive
timeouts (gRPC's own threads still answer the pings: nothing may be lost).

Heartbeats, in-process and cheap: a real CoordinatorServer, fake workers
(tests/_grpc_client.py) that send nothing unless told, and the worker's real
ControlClient.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddl.core import config as _config
from ddl.core.errors import ConfigError, CoordinatorLostError, PeerLostError
from ddl.runtime.control import ControlClient
from ddl.server import CoordinatorServer
from ddl.v1 import coordinator_pb2 as pb

from _grpc_client import JOB, SECRET, Client, register_all

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path):
    made = []

    def make(size, **kw):
        srv = CoordinatorServer(JOB, SECRET, size, "127.0.0.1:0", start_timeout=10, **kw)
        srv.start()
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop(0.2)


def test_a_silent_worker_is_lost_after_the_liveness_timeout(server):
    srv = server(2, heartbeat_interval=0.1, liveness_timeout=0.5)
    alive, frozen = Client(srv.bound_address, 0, 2), Client(srv.bound_address, 1, 2)
    try:
        register_all([alive, frozen])
        alive.open()
        frozen.open()
        stop = threading.Event()

        def beat():  # the healthy worker keeps its stream alive, as ControlClient does
            while not stop.wait(0.1):
                alive._out.put(pb.WorkerMessage(heartbeat=pb.Heartbeat()))

        threading.Thread(target=beat, daemon=True).start()
        t0 = time.monotonic()
        abort = alive.expect("abort", timeout=5).abort
        took = time.monotonic() - t0
        stop.set()
        assert abort.kind == pb.PEER_LOST and abort.origin_rank == 1, abort
        assert "it sent nothing for" in abort.message and "liveness timeout 0.5 s" in abort.message
        assert 0.4 < took < 2.0, took
        # the frozen worker, should it wake up, finds its stream ended with the error
        msg = frozen.expect("abort", timeout=5).abort
        assert msg.origin_rank == 1
        assert frozen.heartbeats >= 1  # the server kept its side of the silent stream alive
    finally:
        alive.close()
        frozen.close()


def test_an_idle_healthy_job_never_times_out(server):
    """Real ControlClients on both sides of idle streams: heartbeats keep them alive."""
    srv = server(2, heartbeat_interval=0.05, liveness_timeout=0.3)
    clients, lost = [], queue.Queue()
    regs = []
    try:
        for rank in range(2):
            clients.append(ControlClient(srv.bound_address, JOB, SECRET, rank,
                                         heartbeat_interval=0.05, liveness_timeout=0.3))
        threads = [threading.Thread(target=lambda c=c: regs.append(c.register(
            size=2, hostname="h", pid=1, data_address="127.0.0.1:1", timeout=10)))
            for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        for c in clients:
            c.start_stream(lambda m: None, lost.put)
        time.sleep(1.5)  # five liveness timeouts of silence but for heartbeats
        assert lost.empty(), lost.get()
        assert not srv.failed
    finally:
        for c in clients:
            c.close()


def test_a_silent_coordinator_is_lost(server):
    """The coordinator's heartbeats are far apart; the worker's liveness is short."""
    srv = server(1, heartbeat_interval=30, liveness_timeout=0)
    client = ControlClient(srv.bound_address, JOB, SECRET, 0, heartbeat_interval=0.05,
                           liveness_timeout=0.3)
    lost = queue.Queue()
    try:
        client.register(size=1, hostname="h", pid=1, data_address="127.0.0.1:1", timeout=10)
        t0 = time.monotonic()
        client.start_stream(lambda m: None, lost.put)
        err = lost.get(timeout=5)
        assert isinstance(err, CoordinatorLostError), err
        assert "sent nothing for" in str(err) and "liveness timeout 0.3 s" in str(err)
        assert time.monotonic() - t0 < 2.0
    finally:
        client.close()


def test_liveness_must_exceed_two_heartbeats():
    with pytest.raises(ConfigError, match="DDL_LIVENESS_TIMEOUT_SECONDS=1 must be at least "
                                          "twice DDL_HEARTBEAT_INTERVAL_SECONDS=0.6"):
        _config.load({"DDL_HEARTBEAT_INTERVAL_SECONDS": "0.6",
                      "DDL_LIVENESS_TIMEOUT_SECONDS": "1"})
    cfg = _config.load({"DDL_HEARTBEAT_INTERVAL_SECONDS": "0.5",
                        "DDL_LIVENESS_TIMEOUT_SECONDS": "0"})
    assert (cfg.heartbeat_interval, cfg.liveness_timeout) == (0.5, 0.0)


def test_a_goodbye_queued_behind_requests_still_leaves_before_the_stream_ends():
    # close() queues Goodbye, then the stop; a batch being drained meets the Goodbye
    # first: it must still be sent before the stream ends (put back behind the stop, it
    # was lost, and the coordinator reported a rank that shut down as frozen)
    from ddl.runtime import control
    client = ControlClient("unix:/nonexistent/ddl.sock", JOB, SECRET, 0)
    try:
        request = pb.Request(name="x", op=pb.ALLREDUCE)
        for item in ([request], [request], pb.Goodbye(rank=0, reason="shutdown"),
                     control._STOP):
            client._outbox.put(item)
        kinds = [(m.WhichOneof("kind"), len(m.requests.requests))
                 for m in client._requests()]
        assert kinds == [("hello", 0), ("requests", 2), ("goodbye", 0)], kinds
    finally:
        client._channel.close()


# -- keepalive: a stopped process is lost, a process holding the GIL is not ----------------

KA_INTERVAL, KA_TIMEOUT = 0.2, 1.0  # short settings
# gRPC's clients pinged once a second at most, whatever the interval (grpcio 1.85): a
# freeze is noticed within max(interval, 1 s) + timeout.
KA_NOTICED_S = max(KA_INTERVAL, 1.0) + KA_TIMEOUT
KA = dict(keepalive_interval=KA_INTERVAL, keepalive_timeout=KA_TIMEOUT)
GIL_HOLD_S = 3 * KA_TIMEOUT  # a C call that keeps the GIL this long must not be a loss

_CHILD_WORKER = f"""
import ctypes, sys, threading
from ddl.runtime.control import ControlClient
address, mode = sys.argv[1], sys.argv[2]
client = ControlClient(address, {JOB!r}, {SECRET!r}, 0, keepalive_interval={KA_INTERVAL},
                       keepalive_timeout={KA_TIMEOUT})
client.register(size=1, hostname="h", pid=__import__("os").getpid(),
                data_address="127.0.0.1:1", timeout=10)
lost = []
client.start_stream(lambda m: None, lost.append)
print("ready", flush=True)
sys.stdin.readline()
if mode == "gil":  # libc's sleep through PyDLL: the GIL stays held for the whole call
    ctypes.PyDLL(None).sleep({int(GIL_HOLD_S)})
    threading.Event().wait(2 * {KA_TIMEOUT})  # a late loss would show up by now
    print("lost: " + repr(lost) if lost else "ok", flush=True)
    client.close()
"""

_CHILD_SERVER = f"""
import ctypes, sys
from ddl.server import CoordinatorServer
srv = CoordinatorServer({JOB!r}, {SECRET!r}, 1, "127.0.0.1:0", start_timeout=10,
                        keepalive_interval={KA_INTERVAL}, keepalive_timeout={KA_TIMEOUT})
print(srv.start(), flush=True)
sys.stdin.readline()
if sys.argv[1] == "gil":
    ctypes.PyDLL(None).sleep({int(GIL_HOLD_S)})
    print("done", flush=True)
srv.wait(30)
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # SIGKILL also ends a stopped process
    proc.wait(5)
    for f in (proc.stdin, proc.stdout):
        f.close()


def _lost_rank(srv, timeout: float):
    """The abort the server's leader sends once rank 0 is lost: its error, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fatal = srv._leader.fatal
        if fatal is not None:
            return fatal
        time.sleep(0.01)
    return None


def test_a_stopped_worker_is_lost_within_the_keepalive_timeout(server):
    srv = server(1, **KA)
    worker = _child(_CHILD_WORKER, srv.bound_address, "stop")
    try:
        assert worker.stdout.readline().strip() == "ready"
        t_stop = time.monotonic()
        os.kill(worker.pid, signal.SIGSTOP)
        fatal = _lost_rank(srv, KA_NOTICED_S + 3)
        took = time.monotonic() - t_stop
        assert fatal is not None, "the stopped worker was never lost"
        assert fatal.origin_rank == 0 and fatal.kind == pb.PEER_LOST, fatal
        assert (f"its process is stopped (SIGSTOP or a debugger): frozen or unreachable: no "
                f"keepalive answer within {KA_TIMEOUT:g} s") in fatal.message, fatal.message
        assert took < KA_NOTICED_S + 1.0, took
    finally:
        _end(worker)


@pytest.mark.parametrize("line, plain, counted", [
    # a SIGKILLed worker whose main thread frees its memory and closes its sockets:
    # still R, but PF_EXITING (0x4) is set
    (b"4242 (python) R 1 4242 4242 0 -1 4195340 0 0", "R", "X"),
    (b"4242 (a) b) S 1 4242 4242 0 -1 4194368 0 0", "S", "S"),  # a ')' in the name
    (b"4242 (python) Z 1 4242 4242 0 -1 4227084 0 0", "Z", "Z"),
    (b"4242 (python) T 1 4242 4242 0 -1 4194304 0 0", "T", "T"),
])
def test_a_process_on_its_way_out_counts_as_ended(line, plain, counted):
    from ddl.core import report
    assert report._state(line) == plain
    assert report._state(line, count_exiting=True) == counted


@pytest.mark.parametrize("exiting", [True, False])
def test_a_worker_whose_stream_closes_on_its_way_out_is_not_called_frozen(
        server, monkeypatch, exiting):
    """A killed worker closes its sockets before it is a zombie (a large one frees its
    memory first, for tens of ms), so the coordinator may find it R: with PF_EXITING it
    ended; a process that is really alive still counts as frozen or unreachable."""
    from ddl.core import report
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    if exiting:
        monkeypatch.setattr(report, "_state",
                            lambda stat, count_exiting=False: "X" if count_exiting else "R")
    srv = server(1)
    worker = Client(srv.bound_address, 0, 1, pid=helper.pid)
    try:
        register_all([worker])
        worker.open()
        deadline = time.monotonic() + 5
        while 0 not in srv._streams and time.monotonic() < deadline:  # hello bound it
            time.sleep(0.01)
        worker.cancel()  # the stream ends without a goodbye
        fatal = _lost_rank(srv, 5)
        assert fatal is not None
        if exiting:
            assert "its process ended without a goodbye" in fatal.message, fatal.message
        else:
            assert "frozen or unreachable: no keepalive answer" in fatal.message, fatal.message
    finally:
        worker.close()
        helper.kill()
        helper.wait(5)


def test_a_worker_holding_the_gil_in_a_c_call_is_not_lost(server):
    srv = server(1, **KA)
    worker = _child(_CHILD_WORKER, srv.bound_address, "gil")
    try:
        assert worker.stdout.readline().strip() == "ready"
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "ok"  # its stream survived
        assert worker.wait(10) == 0
        assert srv._leader.fatal is None, srv._leader.fatal.message
        assert not srv.failed
    finally:
        _end(worker)


@contextlib.contextmanager
def _client_of_a_child_coordinator(mode: str):
    """A child coordinator (``mode``: "stop" or "gil") and a worker's ControlClient with
    a stream to it; yields (coordinator process, its address, client, queue of losses)."""
    coordinator = _child(_CHILD_SERVER, mode)
    client = None
    try:
        address = coordinator.stdout.readline().strip()
        client = ControlClient(address, JOB, SECRET, 0, **KA)
        client.register(size=1, hostname="h", pid=os.getpid(), data_address="127.0.0.1:1",
                        timeout=10)
        lost = queue.Queue()
        client.start_stream(lambda m: None, lost.put)
        yield coordinator, address, client, lost
    finally:
        if client is not None:
            client.close(timeout=0.5)
        _end(coordinator)


def test_a_stopped_coordinator_is_lost_within_the_keepalive_timeout():
    with _client_of_a_child_coordinator("stop") as (coordinator, address, _, lost):
        t_stop = time.monotonic()
        os.kill(coordinator.pid, signal.SIGSTOP)
        err = lost.get(timeout=KA_NOTICED_S + 3)
        took = time.monotonic() - t_stop
        assert isinstance(err, CoordinatorLostError), repr(err)
        assert (f"lost the coordinator at {address}: frozen or unreachable: no keepalive "
                f"answer within {KA_TIMEOUT:g} s") in str(err), str(err)
        assert took < KA_NOTICED_S + 1.0, took


def test_a_coordinator_holding_the_gil_in_a_c_call_is_not_lost():
    with _client_of_a_child_coordinator("gil") as (coordinator, _, _, lost):
        coordinator.stdin.write("go\n")
        coordinator.stdin.flush()
        assert coordinator.stdout.readline().strip() == "done"
        time.sleep(2 * KA_TIMEOUT)  # a late loss would show up by now
        assert lost.empty(), repr(lost.get())


def test_a_worker_that_was_stopped_learns_that_it_was_lost(server):
    """After SIGCONT, the stopped worker's stream is gone: it says that *it* was lost
    (PeerLostError naming itself), not that the coordinator was."""
    srv = server(1, **KA)
    worker = _child(_CHILD_WORKER.replace("sys.stdin.readline()\n", "sys.stdin.readline()\n"
                                          "threading.Event().wait(1.0)\n"
                                          "print(repr(lost), flush=True)\n"),
                    srv.bound_address, "stop")
    try:
        assert worker.stdout.readline().strip() == "ready"
        os.kill(worker.pid, signal.SIGSTOP)
        assert _lost_rank(srv, KA_NOTICED_S + 3) is not None
        time.sleep(KA_TIMEOUT)
        os.kill(worker.pid, signal.SIGCONT)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        line = worker.stdout.readline()
        assert line.startswith("[PeerLostError(") and "rank 0 was lost: this process did " \
            "not run for" in line and "(stopped?)" in line, line
    finally:
        _end(worker)


_SPAWNER = """
import os, subprocess, sys
import numpy as np
import ddl
ddl.init()
ddl.allreduce(np.ones(4), name="warm")   # the control stream and its threads are live
failed = 0
for _ in range(int(sys.argv[1])):
    child = subprocess.Popen(["/bin/true"], preexec_fn=lambda: None)
    failed += child.wait(10) != 0
ddl.shutdown()
print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), failed, flush=True)
"""


def test_children_started_with_preexec_fn_after_init_always_run():
    """gRPC's fork handlers (grpcio >= 1.81) kill about one child in a hundred that
    subprocess forks with a preexec_fn (as PySpark's JVM is) before it can exec, and log
    at every fork (grpc/grpc#43055): ``import ddl`` turns them off before gRPC loads."""
    proc = subprocess.run([sys.executable, "-c", _SPAWNER, "300"], capture_output=True,
                          text=True, timeout=50, env={k: v for k, v in os.environ.items()
                                                      if k != "GRPC_ENABLE_FORK_SUPPORT"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["false", "0"], (proc.stdout, proc.stderr[-2000:])
    assert "fork" not in proc.stderr and "epoll" not in proc.stderr, proc.stderr[-2000:]
