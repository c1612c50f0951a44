"""A job under a flood of unauthenticated connections on every kind of listener it has.

One real job (``ddlrun``, two simulated nodes of one rank each, so that it has all four
kinds of listener: a rank's data-plane port, its response-cache cycle port, the leader
coordinator's unix socket and its peer port for the other node's coordinator). While it
runs, the test holds 1,000 idle connections on each of them and makes connections that
present this job's header (or a wrong ``ddl-auth`` token) with a wrong proof. The ranks
make their first data-plane and cycle connections during the flood and run collectives,
new names and cached ones. Every result must be exact, no rank blamed, every hostile
connection closed by the server within 3x its deadline (its descriptor count back near
the baseline), and the listeners' logs must name the hostile addresses.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import sys
import time

import grpc
import pytest
from test_launcher_support import assert_no_survivors, job_env, script, wait_for_files

from ddl.core import auth as _auth
from ddl.core import limits as _limits
from ddl.dataplane.transports import _handshake
from ddl.v1 import coordinator_pb2 as pb
from ddl.v1 import coordinator_pb2_grpc as pb_grpc

HOSTILE = 1000    # idle connections held on each listener
FORGED = 10       # connections with a wrong proof on each listener
DEADLINE = _limits.UNAUTHENTICATED_DEADLINE_S
FD_SLACK = 24     # descriptors a listener's process may hold above its baseline

WORKER = r"""
import json, os, sys, time
import numpy as np
import ddl
from ddl.runtime import runtime as _runtime

d = os.environ["HOSTILE_DIR"]
ddl.init()
r, n = ddl.rank(), ddl.size()
rt = _runtime.runtime()
info = {"pid": os.getpid(), "job_id": rt.config.job_id,
        "coordinator": rt.config.coordinator_addr, "report_dir": rt.config.report_dir,
        "data": rt.transport._listener.getsockname()[:2],
        "cycles": rt._cycle_transport._listener.getsockname()[:2]}
with open(f"{d}/rank{r}.tmp", "w") as f:
    json.dump(info, f)
os.replace(f"{d}/rank{r}.tmp", f"{d}/rank{r}.json")
stop = time.monotonic() + 120
while not os.path.exists(f"{d}/go"):  # no collective (no connection) before the flood
    if time.monotonic() > stop:
        sys.exit(3)
    time.sleep(0.01)
exact, steps, done = True, 0, False
while not done:
    x = (np.arange(4096, dtype=np.float32) * (r + 1) + steps) / 7
    want = sum((np.arange(4096, dtype=np.float32) * (k + 1) + steps) / 7 for k in range(n))
    exact &= bool(np.array_equal(ddl.allreduce(x, op=ddl.Sum, name="cached"), want))
    fresh = ddl.allreduce(np.full(3, r + 1.0), op=ddl.Sum, name=f"new.{steps}")
    exact &= fresh.tolist() == [n * (n + 1) / 2] * 3
    steps += 1
    flag = np.array([float(os.path.exists(f"{d}/stop") or time.monotonic() > stop)])
    done = bool(ddl.allreduce(flag, op=ddl.Sum, name="stop")[0] > 0)
    time.sleep(0.01)
final = ddl.allreduce(np.array([float(r)]), op=ddl.Sum, name="final").tolist()
print("RESULT " + json.dumps({"rank": r, "exact": exact, "steps": steps, "final": final}),
      flush=True)
ddl.shutdown()
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _leader_pid(job_dir: str) -> int:
    """The leader coordinator of the job whose launcher directory is ``job_dir``."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "ddl.server.daemon" in argv and "--peer-address" in argv and job_dir in argv:
            return int(entry)
    raise AssertionError(f"no leader coordinator of {job_dir} found")


def _connect(address):
    if isinstance(address, str):
        s = socket.socket(socket.AF_UNIX)
        s.connect(address)
    else:
        s = socket.create_connection(tuple(address), timeout=5)
    s.setblocking(False)
    return s


def _forge_tcp(address, job: bytes) -> bytes:
    """This job's header from "rank 0", then a wrong proof: returns all the server sent
    after the header (its nonce, then a refusal byte), up to its hanging up."""
    s = socket.create_connection(tuple(address), timeout=5)
    try:
        s.sendall(_handshake.HEADER.pack(_handshake.MAGIC, _handshake.VERSION, 0, job,
                                         os.urandom(32)))
        got = b""
        while len(got) < _handshake.NONCE_BYTES:
            chunk = s.recv(64)
            assert chunk, got
            got += chunk
        s.sendall(os.urandom(_handshake.MAC_BYTES))
        while True:
            chunk = s.recv(64)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got
    finally:
        s.close()


def _forge_grpc(target: str, job_id: str) -> str:
    """A Register call with a wrong token; returns its status code's name."""
    with grpc.insecure_channel(target) as channel:
        token = _auth.grpc_token(_auth.new_secret(), job_id)
        try:
            pb_grpc.CoordinatorStub(channel).Register(
                pb.RegisterRequest(rank=0, size=2, job_id=job_id),
                metadata=((_auth.GRPC_METADATA_KEY, token),), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _closed_by_server(s: socket.socket) -> bool:
    try:
        while True:
            if not s.recv(65536):  # a gRPC server sends its SETTINGS (and a GOAWAY) first
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.timeout(150)
def test_a_flood_on_every_listener_neither_stops_nor_slows_the_job(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * (HOSTILE + FORGED) + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} is below the {need} this test needs")
    d = tmp_path / "flood"
    d.mkdir()
    env = job_env(tmp_path, HOSTILE_DIR=str(d), DDL_TEST_LOCAL_NODES="1,1")
    proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher.cli", "-np", "2",
                             sys.executable, script(tmp_path, "worker.py", WORKER)],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    held = {}
    try:
        wait_for_files([d / "rank0.json", d / "rank1.json"], within=60)
        ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in (0, 1)]
        job_id, job_dir = ranks[0]["job_id"], os.path.dirname(ranks[0]["report_dir"])
        leader = _leader_pid(job_dir)
        with open(os.path.join(job_dir, "coord.addr")) as f:
            peer_port = f.read().split()[1]
        host, port = peer_port.rsplit(":", 1)
        # rank 0 dials rank 1, so rank 1's ports see the ranks' first connections
        listeners = {
            "data-plane port": (ranks[1]["pid"], ranks[1]["data"],
                                _handshake.job_id_bytes(job_id)),
            "cycle port": (ranks[1]["pid"], ranks[1]["cycles"],
                           _handshake.job_id_bytes(f"{job_id}/cycles")),
            "coordinator socket": (leader, ranks[0]["coordinator"][len("unix:"):], None),
            "leader peer port": (leader, (host, int(port)), None)}
        baseline = {pid: _fds(pid) for pid in (ranks[1]["pid"], leader)}
        ports, forged = {}, {}
        for name, (pid, address, job) in listeners.items():
            held[name] = [_connect(address) for _ in range(HOSTILE)]
            ports[name] = {s.getsockname()[1] for s in held[name]
                           if s.family == socket.AF_INET}
            if job is not None:
                forged[name] = [_forge_tcp(address, job) for _ in range(FORGED)]
            else:
                target = ("unix:" + address if isinstance(address, str)
                          else f"{address[0]}:{address[1]}")
                forged[name] = [_forge_grpc(target, job_id) for _ in range(FORGED)]
        (d / "go").write_text("")  # the ranks' first connections, during the flood
        for name, replies in forged.items():
            if listeners[name][2] is not None:  # a nonce, never a proof; then a refusal
                assert {len(x) for x in replies} == {33}, (name, replies)
                assert {x[-1:] for x in replies} == {b"\0"}, (name, replies)
            else:
                assert set(replies) == {"UNAUTHENTICATED"}, (name, replies)
        # every hostile connection is closed by its server within 3x the deadline
        within = time.monotonic() + 3 * DEADLINE
        while time.monotonic() < within and any(
                _fds(pid) > base + FD_SLACK for pid, base in baseline.items()):
            time.sleep(0.2)
        fds = {pid: _fds(pid) for pid in baseline}
        assert all(fds[pid] <= base + FD_SLACK for pid, base in baseline.items()), \
            (baseline, fds)
        for name, socks in held.items():
            open_ = sum(not _closed_by_server(s) for s in socks)
            assert open_ == 0, f"{open_} hostile connections to the {name} are still open"
        (d / "stop").write_text("")
        out, err = proc.communicate(timeout=60)
    finally:
        for socks in held.values():
            for s in socks:
                s.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    results = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines()
               if "RESULT " in ln]
    assert sorted(x["rank"] for x in results) == [0, 1], out[-2000:]
    for x in results:
        assert x["exact"] and x["final"] == [1.0] and x["steps"] > 0, x
    # nobody blamed; each listener's log names the hostile addresses
    assert not [ln for ln in err.splitlines() if "Error" in ln or "lost" in ln], err[-4000:]
    for name in ("data-plane port", "cycle port"):
        assert any(f"closed the unauthenticated connection from 127.0.0.1:{p}:" in err
                   for p in ports[name]), (name, err[-4000:])
    assert "refused data-plane connection from 127.0.0.1:" in err, err[-4000:]
    assert "failed to prove it knows the job secret" in err, err[-4000:]
    # the coordinator logs one refusal a second: the first, naming its caller
    assert re.search(r"\[coordinator\]<stderr>:ddl-coordinator: refused an unauthenticated "
                     r"call to /ddl.v1.Coordinator/Register from (unix:|ipv4:127\.0\.0\.1:\d+)",
                     err), err[-4000:]
    assert_no_survivors(env["DDL_TEST_MARKER"])
