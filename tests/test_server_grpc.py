"""The coordinator over real gRPC (unix socket and loopback TCP): auth, rendezvous,
negotiation, process sets, join, stalls, lost workers, and the daemon process."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

from ddl.core import limits as _limits
from ddl.core.limits import UNAUTHENTICATED_DEADLINE_S
from ddl.server import CoordinatorServer
from ddl.v1 import coordinator_pb2 as pb
from ddl.v1 import coordinator_pb2_grpc as pb_grpc

from _grpc_client import JOB, SECRET, Client, metadata, register_all, req

# the workers' pids: made up, from Linux's largest pid_max on, so no process has them
NO_PID = 1 << 22

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="ddl-t", dir="/tmp")  # short: unix paths are limited
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def world(sockdir):
    """``world(size, transport="tcp", hosts=None, **server_kw) -> (server, clients)``."""
    made = []

    def make(size, transport="tcp", hosts=None, register=True, **kw):
        addr = f"unix:{sockdir}/c.sock" if transport == "unix" else "127.0.0.1:0"
        kw.setdefault("start_timeout", 10.0)
        srv = CoordinatorServer(JOB, SECRET, size, addr, **kw)
        bound = srv.start()
        clients = [Client(bound, r, size, host=(hosts[r] if hosts else "h"), pid=NO_PID + r)
                   for r in range(size)]
        made.append((srv, clients))
        if register:
            results = register_all(clients)
            assert all(isinstance(x, pb.RegisterResponse) for x in results), results
            for c in clients:
                c.open()
        return srv, clients

    yield make
    for srv, clients in made:
        for c in clients:
            c.close()
        srv.stop(grace=0.2)


def rpc_code(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


# -- auth ------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_auth_rejects_missing_and_wrong_tokens(world, transport):
    srv, (c,) = world(1, transport, register=False)
    stub = c.stub
    code, details = rpc_code(lambda: stub.Ping(pb.PingRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "ddl-auth" in details
    wrong = metadata(secret="cd" * 32)
    code, _ = rpc_code(lambda: stub.Ping(pb.PingRequest(), metadata=wrong, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = rpc_code(lambda: stub.Register(pb.RegisterRequest(rank=0, size=1, job_id=JOB),
                                             metadata=wrong, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    call = stub.Negotiate(iter([pb.WorkerMessage(hello=pb.Hello(rank=0, job_id=JOB))]),
                          metadata=wrong, timeout=5)
    code, _ = rpc_code(lambda: list(call))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # the server is still up and serves the right token
    pong = stub.Ping(pb.PingRequest(), metadata=c.md, timeout=5)
    assert (pong.job_id, pong.size, pong.leader, pong.pid) == (JOB, 1, True, os.getpid())


def _raw_connection(address):
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(address[len("unix:"):])
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
    s.setblocking(False)
    return s


def _closed_by_server(s) -> bool:
    try:
        while True:
            if not s.recv(65536):  # after the server's SETTINGS frame (and GOAWAY)
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_connections_that_never_authenticate_are_closed_but_streams_stay(world, caplog,
                                                                         monkeypatch):
    """On both kinds of listener: raw connections (no HTTP/2), an HTTP/2 connection with
    no call and one with only a refused call are closed within 3x the deadline (measured:
    about 1x after the connection or 2x after the refused call); a worker's stream, with
    nothing to say for longer than that, stays open. (The deadline is halved here: the
    servers read it as they start.)"""
    deadline = UNAUTHENTICATED_DEADLINE_S / 2
    monkeypatch.setattr(_limits, "UNAUTHENTICATED_DEADLINE_S", deadline)
    caplog.set_level("WARNING", logger="ddl.server")
    servers = [world(1, transport, liveness_timeout=0)  # these fake workers send nothing
               for transport in ("unix", "tcp")]
    raw, states = [], []
    for srv, _ in servers:
        raw += [_raw_connection(srv.bound_address) for _ in range(20)]
        for token in (None, metadata(secret="cd" * 32)):
            channel = grpc.insecure_channel(  # a connection of its own, not the worker's
                srv.bound_address, options=[("grpc.use_local_subchannel_pool", 1)])
            seen = []
            channel.subscribe(seen.append)
            grpc.channel_ready_future(channel).result(timeout=5)
            if token is not None:
                rpc_code(lambda: pb_grpc.CoordinatorStub(channel).Ping(
                    pb.PingRequest(), metadata=token, timeout=5))
            states.append((channel, seen))
    def dropped(seen):  # the server closed the connection: the channel went idle
        ready = seen.index(grpc.ChannelConnectivity.READY)
        return grpc.ChannelConnectivity.IDLE in seen[ready:]

    stop = time.monotonic() + 3 * deadline
    while time.monotonic() < stop and not (all(_closed_by_server(s) for s in raw)
                                           and all(dropped(seen) for _, seen in states)):
        time.sleep(0.1)
    assert all(_closed_by_server(s) for s in raw)
    assert all(dropped(seen) for _, seen in states), states
    for s in raw:
        s.close()
    for channel, _ in states:
        channel.close()
    for _, (c,) in servers:  # the workers' streams carry on
        c.send(req("after-idle"))
        assert [t.name for t in c.responses(1)[0].tensors] == ["after-idle"]
    refusals = [r.getMessage() for r in caplog.records if "refused an unauthenticated" in r.getMessage()]
    assert any(m.endswith("/ddl.v1.Coordinator/Ping from unix:") for m in refusals), refusals
    assert any(re.search(r"/Ping from ipv4:127\.0\.0\.1:\d+$", m) for m in refusals), refusals


# -- register --------------------------------------------------------------------------
def test_register_rendezvous_and_uneven_topology(world):
    srv, clients = world(4, hosts=["h1", "h1", "h1", "h2"], register=False)
    results = register_all(clients)
    assert [p.hostname for p in results[0].peers] == ["h1", "h1", "h1", "h2"]
    assert [p.data_address for p in results[2].peers][3] == "127.0.0.1:5003"
    r3, r1 = results[3], results[1]
    assert (r3.local_rank, r3.local_size, r3.cross_rank, r3.cross_size) == (0, 1, 1, 2)
    assert (r1.local_rank, r1.local_size, r1.cross_rank, r1.cross_size) == (1, 3, 0, 1)
    assert not r1.is_homogeneous and r1.fusion_threshold_bytes == 64 << 20


def test_register_timeout_names_missing_ranks(world):
    srv, clients = world(3, register=False, start_timeout=0.6)
    code, details = rpc_code(lambda: clients[1].register())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "missing ranks [0, 2]" in details and "1 of 3 ranks registered" in details
    assert srv.wait(5) and srv.failed


def test_register_rejects_duplicates_and_bad_fields(world):
    srv, clients = world(2, register=False, start_timeout=5)
    import threading
    t = threading.Thread(target=lambda: clients[0].register(), daemon=True)
    t.start()
    time.sleep(0.3)
    code, details = rpc_code(lambda: clients[1].register(rank=0, pid=77))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 0 is already registered by host h pid 4194304" in details
    code, details = rpc_code(lambda: clients[1].register(rank=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of range [0, 2)" in details
    code, details = rpc_code(lambda: clients[1].register(size=3))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "expects job size 3" in details
    code, details = rpc_code(lambda: clients[1].register(job_id="other"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "job id 'other'" in details
    clients[1].register()
    t.join(5)


# -- negotiation -----------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_negotiation_order_mismatch_and_clean_exit(world, sockdir, transport):
    srv, (c0, c1) = world(2, transport, fusion_threshold=0)
    if transport == "unix":
        mode = stat.S_IMODE(os.stat(f"{sockdir}/c.sock").st_mode)
        assert mode == 0o600
    c0.send(req("a"), req("b"))
    c1.send(req("b"))
    c0.send(req("c"))
    c1.send(req("c"), req("a"))
    got = [[(r.seq, r.tensors[0].name) for r in c.responses(3)] for c in (c0, c1)]
    assert got[0] == got[1]  # one global order, whatever order the ranks submitted in
    assert [seq for seq, _ in got[0]] == [1, 2, 3]
    assert sorted(name for _, name in got[0]) == ["a", "b", "c"]
    c0.send(req("grad/fc1", shape=(17, 17)))
    c1.send(req("grad/fc1", shape=(18, 17)))
    errs = [c.responses(1)[0].error for c in (c0, c1)]
    assert errs[0] == errs[1] and errs[0].kind == pb.MISMATCH
    assert errs[0].message == ("allreduce 'grad/fc1': shape mismatch: rank 0 sent "
                               "float32[17,17], rank 1 sent float32[18,17]")
    c0.send(req("d"))
    c1.send(req("d"))
    assert [r.seq for r in c1.responses(1)] == [r.seq for r in c0.responses(1)] == [5]
    for c in (c0, c1):
        c.goodbye()
    for c in (c0, c1):
        assert c.recv() == ("end", None)
    assert srv.wait(5) and not srv.failed
    srv.stop()
    srv.stop()  # idempotent
    if transport == "unix":
        assert not os.path.exists(f"{sockdir}/c.sock")


def test_fusion_over_grpc(world):
    srv, (c0, c1) = world(2, fusion_threshold=32)
    for c in (c0, c1):
        c.send(req("a"), req("b"), req("c"))
    rs = c0.responses(2)
    assert [[t.name for t in r.tensors] for r in rs] == [["a", "b"], ["c"]]
    assert rs == c1.responses(2)


def test_process_sets_over_grpc(world):
    srv, cs = world(4)
    add = pb.Request(name="ps", op=pb.ADD_PROCESS_SET, member_ranks=[0, 1])
    add2 = pb.Request(name="ps", op=pb.ADD_PROCESS_SET, member_ranks=[2, 3])
    for i, c in enumerate(cs):
        c.send(add if i < 2 else add2)
    ids = [c.responses(1)[0].new_process_set_id for c in cs]
    assert ids[0] == ids[1] and ids[2] == ids[3] and {ids[0], ids[2]} == {1, 2}
    s01, s23 = ids[0], ids[2]
    cs[0].send(req("x", process_set_id=s01))  # pending in one set...
    cs[2].send(req("y", process_set_id=s23))
    cs[3].send(req("y", process_set_id=s23))  # ...never blocks the other
    r = cs[2].responses(1)[0]
    assert r.tensors[0].name == "y" and list(r.member_ranks) == [2, 3]
    assert cs[3].responses(1)[0] == r
    cs[1].send(req("x", process_set_id=s01))
    assert cs[0].responses(1)[0].tensors[0].name == "x"
    cs[2].send(req("z", process_set_id=s01))
    err = cs[2].responses(1)[0].error
    assert err.kind == pb.INVALID and "rank 2 is not a member of process set" in err.message
    cs[2].send(req("z", process_set_id=42))
    assert cs[2].responses(1)[0].error.kind == pb.UNKNOWN_PROCESS_SET
    rm = pb.Request(name="rm", op=pb.REMOVE_PROCESS_SET, process_set_id=s23)
    cs[2].send(rm)
    cs[3].send(rm)
    assert cs[3].responses(1)[0].op == cs[2].responses(1)[0].op == pb.REMOVE_PROCESS_SET
    cs[3].send(req("w", process_set_id=s23))
    assert cs[3].responses(1)[0].error.kind == pb.UNKNOWN_PROCESS_SET


def test_join_over_grpc(world):
    srv, (c0, c1) = world(2)
    c1.send(pb.Request(name="join", op=pb.JOIN))
    c0.send(req("x"))
    for c in (c0, c1):
        r = c.responses(1)[0]
        assert r.tensors[0].name == "x" and list(r.joined_ranks) == [1]
    c0.send(req("g", op=pb.ALLGATHER, shape=(3, 2)))
    assert list(c1.responses(1)[0].tensors[0].first_dims) == [3, 0]
    c0.responses(1)
    c0.send(pb.Request(name="join", op=pb.JOIN))
    for c in (c0, c1):
        r = c.responses(1)[0]
        assert r.op == pb.JOIN and r.last_joined_rank == 0


def test_stall_warning_then_abort_and_heartbeats(world):
    srv, (c0, c1) = world(2, stall_check_time=0.3, stall_shutdown_time=1.5)
    c0.send(req("x"))
    for c in (c0, c1):
        w = c.expect("warning", timeout=3).warning
        assert w.kind == pb.STALL and w.message.startswith(
            "stall: allreduce 'x' in process set 0 has waited")
        assert w.message.endswith("submitted by ranks [0], missing ranks [1]")
    for c in (c0, c1):
        a = c.expect("abort", timeout=5).abort
        assert a.kind == pb.STALL and a.message.startswith("allreduce 'x'")
        assert c.recv() == ("end", None)
    assert c0.heartbeats >= 1  # idle > 1 s between the warning and the abort
    assert srv.wait(5) and srv.failed


def test_lost_worker_aborts_the_others(world):
    srv, cs = world(3)
    cs[1].send(req("x"))
    time.sleep(0.2)
    cs[2].cancel()
    for c in (cs[0], cs[1]):
        a = c.expect("abort").abort
        assert a.kind == pb.PEER_LOST and a.origin_rank == 2 and a.origin_pid == NO_PID + 2
        # (its pid is made up: no such process, so it "ended")
        assert a.message == ("rank 2 (host h, pid 4194306) was lost: its process ended "
                             "without a goodbye (killed, or it crashed); in flight: allreduce 'x', "
                             "submitted by ranks [1]")
        assert (a.op, a.name) == ("allreduce", "x")
    assert srv.wait(5) and srv.failed


def test_goodbye_then_pending_name_fails_peer_lost(world):
    srv, cs = world(3)
    cs[0].send(req("x"))
    time.sleep(0.2)
    cs[1].goodbye()
    assert cs[1].recv() == ("end", None)
    err = cs[0].responses(1)[0].error
    assert err.kind == pb.PEER_LOST
    assert err.message == "allreduce 'x': rank 1 (host h, pid 4194305) has shut down"
    cs[2].send(req("y"))
    assert cs[2].responses(1)[0].error.message == ("allreduce 'y': rank 1 (host h, pid 4194305) "
                                                   "has shut down")
    cs[0].goodbye()
    cs[2].goodbye()
    assert srv.wait(5) and not srv.failed


def test_bad_hello_is_refused(world):
    srv, (c0, c1) = world(2, register=False)
    register_all([c0, c1])
    c0.open(hello=pb.WorkerMessage(requests=pb.RequestList(rank=0)))
    kind, exc = c0.recv()
    assert kind == "error" and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message must be hello" in exc.details()
    bad = Client(srv.bound_address, 1, 2)
    bad.open(hello=pb.WorkerMessage(hello=pb.Hello(rank=7, job_id=JOB)))
    kind, exc = bad.recv()
    assert kind == "error" and "rank 7, which has not registered" in exc.details()
    bad.close()
    c1.open()
    c1.send(req("solo", process_set_id=0))  # still waits for rank 0: no crash
    assert not srv.wait(0.2)


# -- the daemon ------------------------------------------------------------------------
def _daemon(sockdir, size, *extra):
    env = dict(os.environ, DDL_JOB_ID=JOB, DDL_JOB_SECRET=SECRET)
    addr = f"unix:{sockdir}/d.sock"
    proc = subprocess.Popen([sys.executable, "-m", "ddl.server.daemon", "--address", addr,
                             "--size", str(size), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line == addr, proc.stderr.read() if not line else line
    return proc, addr


def test_daemon_exits_0_after_goodbyes(sockdir):
    proc, addr = _daemon(sockdir, 2)
    try:
        assert stat.S_IMODE(os.stat(addr[5:]).st_mode) == 0o600
        cs = [Client(addr, r, 2) for r in range(2)]
        register_all(cs)
        for c in cs:
            c.open()
            c.send(req("x"))
        for c in cs:
            assert c.responses(1)[0].seq == 1
            c.goodbye()
        assert proc.wait(10) == 0
        for c in cs:
            c.close()
    finally:
        proc.kill()
        proc.wait()


def test_daemon_sigterm_aborts_and_exits_1(sockdir):
    proc, addr = _daemon(sockdir, 1)
    try:
        c = Client(addr, 0, 1)
        c.register()
        c.open()
        c.send(req("x"))
        c.responses(1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        a = c.expect("abort").abort
        assert a.kind == pb.SHUTDOWN and "SIGTERM" in a.message
        assert proc.wait(5) == 1
        assert time.monotonic() - t0 < 2.0
        assert "ddl-coordinator:" in proc.stderr.read()
        c.close()
    finally:
        proc.kill()
        proc.wait()


def test_daemon_start_timeout_exits_1(sockdir):
    proc, _ = _daemon(sockdir, 2, "--start-timeout", "0.5")
    try:
        assert proc.wait(10) == 1
        assert "missing ranks [0, 1]" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_embedded_size_one_job(world):
    srv, (c,) = world(1)
    c.send(req("x"), req("y"), pb.Request(name="b", op=pb.BARRIER))
    rs = c.responses(2)
    assert [[t.name for t in r.tensors] for r in rs] == [["x", "y"], ["b"]]
    c.goodbye()
    assert c.recv() == ("end", None)
    assert srv.wait(5) and not srv.failed


def test_refusals_are_logged_at_most_once_per_second(caplog):
    from ddl.server.auth import AuthInterceptor
    auth = AuthInterceptor(SECRET, JOB)
    with caplog.at_level("WARNING", logger="ddl.server"):
        for _ in range(50):
            auth._note_refusal("/ddl.v1.Coordinator/Ping")
    assert auth.refused == 50
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


def test_daemon_refuses_a_socket_dir_others_can_enter(sockdir):
    os.chmod(sockdir, 0o755)
    env = dict(os.environ, DDL_JOB_ID=JOB, DDL_JOB_SECRET=SECRET)
    proc = subprocess.run([sys.executable, "-m", "ddl.server.daemon", "--address",
                           f"unix:{sockdir}/d.sock", "--size", "1"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "has mode 0755; it must be 0700" in proc.stderr
    assert proc.stderr.startswith("ddl-coordinator: ")
