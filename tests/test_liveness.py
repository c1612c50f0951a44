"""Liveness: heartbeats on idle control streams; a silent worker or coordinator is lost.

In-process and cheap: a real CoordinatorServer, fake workers (tests/_grpc_client.py) that
send nothing unless told, and the worker's real ControlClient.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from ddl import _config
from ddl._control import ControlClient
from ddl._errors import ConfigError, CoordinatorLostError
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
