"""Several coordinators: a leader and non-leader coordinators relaying over TCP.

``DDL_TEST_LOCAL_NODES`` makes the launcher split this host into simulated nodes, each
with its own coordinator daemon and host name; the non-leaders reach the leader over
loopback TCP (``PeerLink``). The data plane is the same as on one node.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import ddl
import _checks
from test_launcher_support import (assert_no_survivors, ddlrun, job_env, marked_pids,
                                   script, wait_for_files)


def _world_checks():
    """Topology as two nodes see it, then collectives, process sets and join."""
    out = []
    host = os.environ["DDL_HOSTNAME"]
    want = (ddl.rank() % 2, 2, ddl.rank() // 2, 2, True)
    got = (ddl.local_rank(), ddl.local_size(), ddl.cross_rank(), ddl.cross_size(),
           ddl.is_homogeneous())
    if got != want:
        out.append(f"rank {ddl.rank()}: topology {got}, expected {want}")
    if not host.endswith(f"-node{ddl.rank() // 2}"):
        out.append(f"rank {ddl.rank()}: host name {host!r}")
    hosts = ddl.allgather(np.array([zlib.crc32(host.encode())], np.int64), name="hosts")
    if not (hosts[0] == hosts[1] != hosts[2] == hosts[3]):
        out.append(f"rank {ddl.rank()}: host hashes {hosts}")
    out += _checks.check_collectives()
    out += _checks.check_process_sets()
    out += _checks.check_join()
    return out


@pytest.mark.timeout(240)
def test_two_nodes_run_every_collective():
    results = ddl.run(_world_checks, np=4, env={"DDL_TEST_LOCAL_NODES": "2,2"})
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def test_uneven_nodes_topology():
    def topo():
        return (ddl.local_rank(), ddl.local_size(), ddl.cross_rank(), ddl.cross_size(),
                ddl.is_homogeneous(), float(ddl.allreduce(np.float64(ddl.rank() + 1), op=ddl.Sum)))
    got = ddl.run(topo, np=3, env={"DDL_TEST_LOCAL_NODES": "2,1"})
    assert got == [(0, 2, 0, 2, False, 6.0), (1, 2, 0, 1, False, 6.0),
                   (0, 1, 1, 2, False, 6.0)]


# Every rank writes its pid to PIDDIR/<rank> and allreduces in a loop; the test kills
# a process; every rank writes the error it raised to PIDDIR/<rank>.err. SIGTERM is
# ignored so that ddlrun's teardown (KILL after 5 s) does not race the error report.
LOOP = r'''
import os, signal, sys, time
import numpy as np
import ddl
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ddl.init()
piddir, action = sys.argv[1], sys.argv[2]
with open(os.path.join(piddir, str(ddl.rank())) + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(piddir, str(ddl.rank())) + ".tmp", os.path.join(piddir, str(ddl.rank())))
x = np.ones(1 << 16, np.float32)
try:
    step = 0
    while True:
        ddl.allreduce(x, name="grad", op=ddl.Sum)
        step += 1
        if action == "rank3_dies" and ddl.rank() == 3 and step == 20:
            os._exit(7)
except ddl.DDLError as exc:
    path = os.path.join(piddir, f"{ddl.rank()}.err")
    with open(path + ".tmp", "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
    os.replace(path + ".tmp", path)
    raise SystemExit(1)
'''


def _start(tmp_path, action):
    path = script(tmp_path, "loop.py", LOOP)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = job_env(tmp_path, DDL_TEST_LOCAL_NODES="2,2")
    return path, piddir, env


def _errors(piddir, ranks):
    wait_for_files([piddir / f"{r}.err" for r in ranks], within=15)
    return {r: (piddir / f"{r}.err").read_text() for r in ranks}


@pytest.mark.timeout(60)
def test_rank_lost_on_a_relayed_node(tmp_path):
    path, piddir, env = _start(tmp_path, "rank3_dies")
    t0 = time.monotonic()
    r = ddlrun(["-np", "4", sys.executable, path, str(piddir), "rank3_dies"], env, timeout=40)
    elapsed = time.monotonic() - t0
    assert r.returncode == 7, r.stderr
    assert re.search(r"ddlrun: rank 3 \(pid \d+\) exited with code 7", r.stderr), r.stderr
    errs = _errors(piddir, [0, 1, 2])
    for rank, text in errs.items():
        assert text.startswith("PeerLostError: "), (rank, text)
        assert re.search(r"rank 3 \(host \S+-node1, pid \d+\) was lost", text), (rank, text)
    assert elapsed < 15, elapsed
    assert_no_survivors(env["DDL_TEST_MARKER"])


def _relay_pid(marker: str) -> int:
    for pid in marked_pids(marker):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"--leader" in f.read().split(b"\0"):
                return pid
    raise AssertionError("no relay coordinator found")


@pytest.mark.timeout(60)
def test_relay_coordinator_killed(tmp_path):
    import signal
    import subprocess
    path, piddir, env = _start(tmp_path, "loop")
    proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher.cli", "-np", "4",
                             sys.executable, path, str(piddir), "loop"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([piddir / str(r) for r in range(4)])
        time.sleep(0.3)
        relay = _relay_pid(env["DDL_TEST_MARKER"])
        t0 = time.monotonic()
        os.kill(relay, signal.SIGKILL)
        try:
            errs = _errors(piddir, [0, 1, 2, 3])
        except AssertionError:
            proc.kill()
            raise AssertionError(proc.communicate(timeout=20)[1]) from None
        raised_within = time.monotonic() - t0
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    for rank in (2, 3):  # its own workers lose their coordinator
        assert errs[rank].startswith("CoordinatorLostError: "), (rank, errs[rank])
    for rank in (0, 1):  # the others learn that node 1's coordinator is gone
        assert errs[rank].startswith("CoordinatorLostError: "), (rank, errs[rank])
        assert re.search(r"the coordinator of host \S+-node1 \(pid \d+\) was lost",
                         errs[rank]), errs[rank]
        assert "[2, 3]" in errs[rank], errs[rank]
    assert raised_within < 5, raised_within
    assert proc.returncode != 0, err
    assert_no_survivors(env["DDL_TEST_MARKER"])


# -- in-process: a leader and a relay with fake workers ----------------------------------

import grpc  # noqa: E402

from ddl.server import CoordinatorServer, RelayServer  # noqa: E402
from ddl.v1 import coordinator_pb2 as pb  # noqa: E402
from ddl.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402

from _grpc_client import JOB, SECRET, Client, metadata, register_all, req  # noqa: E402


@pytest.fixture
def pair(tmp_path):
    """A leader (1 local worker) and a relay (2 workers) of a 3-rank job."""
    made = []

    def make(liveness=10.0):
        leader = CoordinatorServer(JOB, SECRET, 3, f"unix:{tmp_path}/l.sock",
                                   start_timeout=10, liveness_timeout=liveness)
        leader.listen_also("127.0.0.1:0")
        leader.start()
        relay = RelayServer(JOB, SECRET, 3, f"unix:{tmp_path}/r.sock",
                            leader.extra_bound[0], 2, "nodeB", start_timeout=5,
                            liveness_timeout=liveness)
        relay.start()
        made.extend([relay, leader])
        clients = [Client(leader.bound_address, 0, 3, host="nodeA"),
                   Client(relay.bound_address, 1, 3, host="nodeB"),
                   Client(relay.bound_address, 2, 3, host="nodeB")]
        made.extend(clients)
        return leader, relay, clients

    yield make
    for thing in made:
        thing.close() if isinstance(thing, Client) else thing.stop(0.2)


def test_relay_negotiates_through_the_leader(pair):
    leader, relay, clients = pair()
    regs = register_all(clients)
    assert [(r.local_rank, r.local_size, r.cross_rank) for r in regs] == [
        (0, 1, 0), (0, 2, 1), (1, 2, 0)]
    pong = pb_grpc.CoordinatorStub(clients[1].channel).Ping(
        pb.PingRequest(), metadata=metadata(), timeout=5)
    assert (pong.leader, pong.registered, pong.size) == (False, 2, 3)
    for c in clients:
        c.open()
    for c in reversed(clients):  # any submission order: one global order comes back
        c.send(req("b"), req("a"))
    orders = [[t.name for t in c.responses(1)[0].tensors] for c in clients]  # fused
    assert orders[0] == orders[1] == orders[2] and sorted(orders[0]) == ["a", "b"]
    clients[2].send(req("m", shape=(5,)))
    clients[0].send(req("m"))
    clients[1].send(req("m"))
    errors = [c.responses(1)[0].error for c in clients]
    assert all(e.kind == pb.MISMATCH and "rank 2 sent float32[5]" in e.message
               for e in errors), errors
    for c in clients:
        c.goodbye()
    assert leader.wait(5) and relay.wait(5)
    assert not leader.failed and not relay.failed


def test_relayed_worker_lost_aborts_everyone(pair):
    leader, relay, clients = pair()
    register_all(clients)
    for c in clients:
        c.open()
    clients[0].send(req("x"))
    time.sleep(0.2)
    clients[2].cancel()  # rank 2 vanishes without a goodbye
    for c in clients[:2]:
        abort = c.expect("abort").abort
        assert abort.kind == pb.PEER_LOST and abort.origin_rank == 2, abort
        assert "rank 2 (host nodeB" in abort.message
    assert leader.wait(5) and relay.wait(5) and leader.failed and relay.failed


def test_leader_lost_aborts_relayed_workers(pair):
    leader, relay, clients = pair()
    register_all(clients)
    for c in clients:
        c.open()
    time.sleep(0.2)
    leader.stop(0)
    for c in clients[1:]:
        abort = c.expect("abort").abort
        assert abort.kind == pb.COORDINATOR_LOST, abort
        assert f"the leader coordinator at {relay.leader_address} was lost" in abort.message
    assert relay.wait(5) and relay.failed


def test_silent_peer_link_is_lost_after_liveness_timeout(tmp_path):
    """The application-level check: a peer whose connection answers keepalive pings
    (gRPC's threads) but which sends nothing at all (its Python wedged)."""
    leader = CoordinatorServer(JOB, SECRET, 2, f"unix:{tmp_path}/l.sock", start_timeout=10,
                               liveness_timeout=0.5)
    leader.listen_also("127.0.0.1:0")
    leader.start()
    direct = Client(leader.bound_address, 0, 2, host="nodeA")
    relayed = Client(leader.bound_address, 1, 2, host="nodeB")
    channel = grpc.insecure_channel(leader.extra_bound[0])
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        register_all([direct, relayed])
        direct.open()
        hello = pb.WorkerMessage(hello=pb.Hello(rank=1, job_id=JOB))
        sent = [pb.PeerMessage(hello=pb.PeerHello(job_id=JOB, hostname="nodeB", pid=42)),
                pb.PeerMessage(worker=pb.RankMessage(rank=1, message=hello))]

        def frozen_peer():  # says hello for rank 1, then nothing at all
            yield from sent
            time.sleep(30)

        call = stub.PeerLink(frozen_peer(), metadata=metadata(), timeout=30)
        t0 = time.monotonic()
        beating = threading.Event()

        def heartbeats():  # rank 0 stays alive, however loaded the machine is
            while not beating.wait(0.05):
                direct._out.put(pb.WorkerMessage(heartbeat=pb.Heartbeat()))

        threading.Thread(target=heartbeats, daemon=True).start()
        try:
            abort = direct.expect("abort", timeout=5).abort
        finally:
            beating.set()
        assert time.monotonic() - t0 < 2.0
        assert abort.kind == pb.COORDINATOR_LOST, abort
        assert ("the coordinator of host nodeB (pid 42) was lost: no message for" in
                abort.message and "its ranks [1]" in abort.message), abort.message
        call.cancel()
    finally:
        direct.close()
        relayed.close()
        channel.close()
        leader.stop(0.2)


_FROZEN_RELAY = f"""
import sys
from ddl.server import RelayServer
relay = RelayServer({JOB!r}, {SECRET!r}, 2, sys.argv[1], sys.argv[2], 1, "nodeB",
                    start_timeout=5, keepalive_interval=0.2, keepalive_timeout=1.0)
relay.start()
print("ready", flush=True)
relay.wait(60)
"""


def test_a_stopped_relay_is_lost_within_the_keepalive_timeout(tmp_path):
    """The relay coordinator of node B (a child process) is stopped: its link answers no
    keepalive ping, and the leader aborts node A's worker naming node B's coordinator."""
    import signal
    import subprocess

    leader = CoordinatorServer(JOB, SECRET, 2, f"unix:{tmp_path}/l.sock", start_timeout=10,
                               keepalive_interval=0.2, keepalive_timeout=1.0)
    leader.listen_also("127.0.0.1:0")
    leader.start()
    relay = subprocess.Popen([sys.executable, "-c", _FROZEN_RELAY, f"unix:{tmp_path}/r.sock",
                              leader.extra_bound[0]], stdout=subprocess.PIPE, text=True)
    direct = Client(leader.bound_address, 0, 2, host="nodeA")
    relayed = Client(f"unix:{tmp_path}/r.sock", 1, 2, host="nodeB")
    try:
        assert relay.stdout.readline().strip() == "ready"
        register_all([direct, relayed])
        direct.open()
        relayed.open()
        time.sleep(0.3)  # the relayed hello reached the leader
        t0 = time.monotonic()
        os.kill(relay.pid, signal.SIGSTOP)
        abort = direct.expect("abort", timeout=10).abort
        took = time.monotonic() - t0
        assert abort.kind == pb.COORDINATOR_LOST, abort
        assert (f"the coordinator of host nodeB (pid {relay.pid}) was lost: the link "
                in abort.message and "it exited, or is frozen or unreachable: no keepalive "
                "answer within 1 s; its ranks [1]" in abort.message), abort.message
        assert took < 1.0 + 1.0 + 1.0, took  # a ping within 1 s, 1 s to answer, slack
    finally:
        relay.kill()
        relay.wait(5)
        relay.stdout.close()
        direct.close()
        relayed.close()
        leader.stop(0.2)


def test_peer_link_refusals(tmp_path, pair):
    leader, relay, _ = pair()
    for address, hello, code in [
            (leader.extra_bound[0], pb.PeerHello(job_id="other", hostname="x"),
             grpc.StatusCode.INVALID_ARGUMENT),
            (relay.bound_address, pb.PeerHello(job_id=JOB, hostname="x"),
             grpc.StatusCode.FAILED_PRECONDITION)]:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            call = stub.PeerLink(iter([pb.PeerMessage(hello=hello)]), metadata=metadata(),
                                 timeout=5)
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == code
    with grpc.insecure_channel(leader.extra_bound[0]) as channel:
        call = pb_grpc.CoordinatorStub(channel).PeerLink(iter([]), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_relay_without_a_leader_fails_to_start(tmp_path):
    relay = RelayServer(JOB, SECRET, 2, f"unix:{tmp_path}/r.sock", "127.0.0.1:9", 1, "b",
                        start_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not reach the leader coordinator at "
                                           "127.0.0.1:9 within 0.5 s"):
        relay.start()
    assert time.monotonic() - t0 < 3
    relay.stop(0)
