"""Jobs over several hosts: ``ddlrun -H`` over ssh to test hosts made of network
namespaces, each with its own address and sshd (tests/_netns.py). They need root,
iproute2 and openssh-server (CI installs them and runs as root); elsewhere they skip and
say why. The leak check (conftest) also sees the remote processes: they carry the test's
marker variable, which ddlrun forwards like every ``DDL_*`` variable."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
from test_launcher_support import ddlrun, job_env

import _netns

WHY = _netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no test hosts: {WHY}")

CHECKS = r"""
import json, os, subprocess, sys
secret = os.environ["DDL_JOB_SECRET"].encode()  # import ddl takes it out of the environment
import numpy as np, ddl
ddl.init()
r, n = ddl.rank(), ddl.size()
out = {"rank": r, "host": os.environ["DDL_HOSTNAME"], "cwd": os.getcwd(),
       "forwarded": os.environ.get("FWD_X"), "not_forwarded": os.environ.get("NOT_FWD"),
       "topo": [ddl.local_rank(), ddl.local_size(), ddl.cross_rank(), ddl.cross_size(),
                ddl.is_homogeneous()]}
ok = {}
big = np.arange(1 << 20, dtype=np.float32) + r
ok["allreduce"] = bool(np.array_equal(ddl.allreduce(big, op=ddl.Sum, name="big"),
                                      np.arange(1 << 20, dtype=np.float32) * n + n * (n - 1) / 2))
ok["small"] = float(ddl.allreduce(np.array([1.0]), op=ddl.Sum, name="s")[0]) == n
# every size, dtype and op, against NumPy (hierarchical where hosts hold equal shares)
rng = np.random.default_rng(5)
ops = {"Sum": (ddl.Sum, np.sum), "Max": (ddl.Max, np.max), "Min": (ddl.Min, np.min),
       "Product": (ddl.Product, np.prod)}
for count in (0, 1, 3, 4097, 300001):
    for dt in (np.float32, np.float64, np.int32, np.uint8):
        every = [(rng.integers(0, 3, count) + k).astype(dt) for k in range(n)]
        for op_name, (op, ref) in ops.items():
            if op_name == "Product" and count > 4097:
                continue
            got = ddl.allreduce(every[r], op=op, name=f"m/{count}/{np.dtype(dt).name}/{op_name}")
            want = ref(np.stack(every), axis=0).astype(dt)
            ok.setdefault("matrix", True)
            if not np.array_equal(got, want):
                ok["matrix"] = False
                out.setdefault("matrix_bad", []).append([count, np.dtype(dt).name, op_name])
for rows_of in ((lambda k: k), (lambda k: 3 * k + 1), (lambda k: 0 if k % 2 else 5000)):
    for dt in (np.float32, np.int64, np.uint8):
        every = [np.full((rows_of(k), 7), k + 1, dt) for k in range(n)]
        got = ddl.allgather(every[r], name=f"g/{rows_of(1)}/{np.dtype(dt).name}")
        ok.setdefault("allgather_matrix", True)
        if not np.array_equal(got, np.concatenate(every)):
            ok["allgather_matrix"] = False
            out.setdefault("allgather_bad", []).append([rows_of(1), np.dtype(dt).name])
avg = ddl.allreduce(np.full(1001, float(r)), name="avg")
ok["average"] = bool(np.allclose(avg, (n - 1) / 2))
rows = ddl.allgather(np.full((r + 1, 3), r, np.int64), name="rows")
ok["allgather"] = rows.shape == (n * (n + 1) // 2, 3) and int(rows[-1, 0]) == n - 1
ok["broadcast"] = int(ddl.broadcast(np.array([r * 7]), root_rank=n - 1, name="b")[0]) == 7 * (n - 1)
got, _ = ddl.alltoall(np.arange(n, dtype=np.int32) + 100 * r, name="a2a")
ok["alltoall"] = got.tolist() == [100 * k + r for k in range(n)]
part = ddl.reducescatter(np.ones((2 * n, 2), np.float64), op=ddl.Sum, name="rs")
ok["reducescatter"] = part.shape == (2, 2) and bool(np.all(part == n))
for step in range(20):  # the response cache's cycles run over TCP between hosts
    ok.setdefault("cached", True)
    ok["cached"] &= float(ddl.allreduce(np.array([float(step)]), op=ddl.Sum, name="c")[0]) == step * n
# the job secret is on no command line of any process on this machine
seen = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if secret in open(f"/proc/{pid}/cmdline", "rb").read():
            seen.append(pid)
    except OSError:
        pass
ok["secret_not_on_command_lines"] = not seen
out["ok"] = ok
print("RESULT " + json.dumps(out), flush=True)
ddl.shutdown()
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = _netns.TestHosts(2, str(tmp_path_factory.mktemp("hosts")))
    yield h
    h.close()


def _results(stdout: str) -> dict:
    found = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", stdout)]
    return {d["rank"]: d for d in found}


@pytest.mark.timeout(240)
def test_two_hosts_every_collective_topology_and_environment(hosts, tmp_path):
    script = tmp_path / "checks.py"
    script.write_text(CHECKS)
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command, FWD_X="yes", NOT_FWD="no")
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    cases = [
        # 2 hosts x 2 ranks
        (["-H", "ddlh1:2,ddlh2:2"], {0: ("ddlh1", [0, 2, 0, 2, True]),
                                     1: ("ddlh1", [1, 2, 0, 2, True]),
                                     2: ("ddlh2", [0, 2, 1, 2, True]),
                                     3: ("ddlh2", [1, 2, 1, 2, True])}),
        # uneven slots, this host among them, a hostfile
        (["--hostfile", "HOSTFILE", "--hierarchical-allreduce", "1"],
         {0: ("localhost", [0, 1, 0, 3, False]),
                                      1: ("ddlh1", [0, 2, 1, 3, False]),
                                      2: ("ddlh1", [1, 2, 0, 1, False]),
                                      3: ("ddlh2", [0, 1, 2, 3, False])}),
    ]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# test hosts\nlocalhost slots=1\nddlh1 slots=2\n\nddlh2  # one\n")
    two = cases[0][1]
    cases = [(cases[0][0] + ["--hierarchical-allreduce", "on", "--hierarchical-allgather",
                             "on"], two), cases[1],
             (["-H", "ddlh1:2,ddlh2:2"], two),  # auto
             # the interface named, so no probe; the ssh flags as well
             (["-H", "ddlh1:2,ddlh2:2", "--hierarchical-allreduce", "off",
               "--hierarchical-allgather", "off", "--network-interface", "eth0",
               "-p", "22", "-i", os.path.join(hosts.dir, "user_key")], two)]
    for (args, want), algorithm in zip(cases, ["hierarchical", "ring", "auto", "ring"]):
        args = [str(hostfile) if a == "HOSTFILE" else a for a in args]
        timeline = tmp_path / f"timeline-{algorithm}-{len(args)}.json"
        r = ddlrun(["-np", "4", *args, "-x", "FWD_X", "--timeline-filename", str(timeline),
                    "--verbose", sys.executable, str(script)], env, timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        # ssh reaches ddlh1 on its management address, which ddlh2 cannot reach: the probe
        # picks the address every other host reaches, for every host
        if "--network-interface" in args:
            assert "ddl-remote: host ddlh1 uses 10.77.0.1 (interface eth0)" in r.stderr
        else:
            assert "ddlrun: host ddlh1 uses 10.77.0.1 (every other host reached it)" in \
                r.stderr
            assert "ddlrun: host ddlh2 uses 10.77.0.2 (every other host reached it)" in \
                r.stderr
        if "localhost" in want[0][0]:
            assert "ddlrun: host localhost uses 10.77.0.254" in r.stderr, r.stderr[-3000:]
        # rank 0's timeline names the algorithm of the 4 MiB allreduce: hierarchical by
        # default when both hosts hold two ranks; a flat ring when switched off, or when
        # the hosts are uneven even if asked for
        trace = json.loads(timeline.read_text())
        names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace
                 if e.get("name") == "thread_name"}
        used = {}
        for e in trace:
            if e.get("name") in ("ALLREDUCE", "ALLGATHER") and \
                    e.get("args", {}).get("algorithm"):
                used.setdefault(names.get((e["pid"], e["tid"])), set()).add(
                    e["args"]["algorithm"])
        if algorithm == "auto":  # allreduce: hierarchical above DDL_SMALL_MESSAGE_BYTES
            assert used["big"] == {"hierarchical"}, used
            assert "hierarchical" not in used["s"], used
            assert "hierarchical" not in used["g/0/float32"], used  # allgather: auto = off
        else:
            assert algorithm in used["big"], used
            assert (algorithm == "hierarchical") == ("hierarchical" in set().union(
                *used.values())), used
        got = _results(r.stdout)
        assert sorted(got) == [0, 1, 2, 3], r.stdout
        for rank, (host, topo) in want.items():
            d = got[rank]
            assert (d["host"], d["topo"]) == (host, topo), (args, d)
            assert all(d["ok"].values()), (args, d)
            assert d["cwd"] == os.getcwd() and d["forwarded"] == "yes", d
            # other variables reach a remote host only with -x
            assert d["not_forwarded"] == ("no" if host == "localhost" else None), d


@pytest.mark.timeout(120)
def test_an_unreachable_host_is_named_within_the_start_timeout(hosts, tmp_path):
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command)
    t0 = time.monotonic()
    r = ddlrun(["-np", "3", "-H", "ddlh1:1,10.77.0.9:1,nosuchhost:1", "--start-timeout", "5",
                sys.executable, "-c", "pass"], env, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "cannot reach host 10.77.0.9 over ssh" in r.stderr, r.stderr
    assert "host nosuchhost over ssh" in r.stderr and "ddlh1" not in r.stderr, r.stderr
    assert took < 20, took


@pytest.mark.timeout(120)
def test_a_failed_remote_rank_ends_the_job_on_every_host(hosts, tmp_path):
    """Rank 3 (on ddlh2) exits 3 while the others wait in an allreduce: they raise an
    error naming rank 3, ddlrun exits non-zero, and nothing is left on any host (leak
    check). (Which rank ddlrun's last line blames is a race across hosts: remote ranks
    cannot leave it the reports that name the first failure on one host.)"""
    script = tmp_path / "fail.py"
    script.write_text("import sys, numpy as np, ddl\nddl.init()\n"
                      "if ddl.rank() == 3:\n    sys.exit(3)\n"
                      "ddl.allreduce(np.ones(4), name='never')\n")
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    t0 = time.monotonic()
    r = ddlrun(["-np", "4", "-H", "ddlh1:2,ddlh2:2", sys.executable, str(script)], env,
               timeout=90)
    assert r.returncode == 3, r.stderr[-3000:]
    assert re.search(r"PeerLostError: allreduce 'never': rank 3 \(host ddlh2", r.stderr), \
        r.stderr[-3000:]
    # the other ranks' reports, relayed from both hosts, name rank 3 as the first failure
    assert "rank 3" in r.stderr.splitlines()[-1], r.stderr[-3000:]
    assert "ddl-report" not in r.stderr  # relayed reports are not output
    assert time.monotonic() - t0 < 40


@pytest.mark.timeout(120)
def test_ddl_bench_compares_with_gloo_across_hosts(hosts, tmp_path):
    """``ddl-bench --compare gloo`` with a rank on each of two hosts: torch.distributed's
    rendezvous is on rank 0's data-plane address (not loopback, which the other host
    cannot reach), and both implementations' results are checked."""
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    r = ddlrun(["-np", "2", "-H", "ddlh1:1,ddlh2:1", sys.executable, "-m", "ddl.bench",
                "--op", "allreduce,allgather", "--sizes", "4,64K", "--compare", "gloo",
                "-n", "3", "-w", "1"], env, timeout=100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "# 4 rows, every result correct" in r.stdout, r.stdout[-3000:]
    assert "gloo: torch.distributed Gloo" in r.stdout, r.stdout[-3000:]


@pytest.mark.timeout(150)
def test_cutting_a_hosts_link_mid_job_fails_the_job_naming_it(hosts, tmp_path):
    """ddlh2's link goes down while 2 x 2 ranks run allreduces: the ranks on ddlh1 raise
    an error naming ddlh2 within the liveness deadline, ddlrun exits non-zero, and the
    processes on both hosts are gone (leak check)."""
    import subprocess
    script = tmp_path / "loop.py"
    script.write_text("import time, numpy as np, ddl\nddl.init()\n"
                      "for step in range(100000):\n"
                      "    ddl.allreduce(np.ones(1000), name='x')\n"
                      "    if ddl.rank() == 0 and step == 20:\n"
                      "        print('running', flush=True)\n"
                      "    time.sleep(0.01)\n")
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher.cli", "-np", "4", "-H",
                             "ddlh1:2,ddlh2:2", "--liveness-timeout-seconds", "4",
                             sys.executable, str(script)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    link = hosts.veth("ddlh2")
    try:
        assert "running" in proc.stdout.readline()
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, err[-3000:]
    first = [ln for ln in err.splitlines() if ln.startswith(("[0]", "[1]")) and "Error" in ln]
    assert any("ddlh2" in ln for ln in first), err[-3000:]
    assert took < 40, (took, err[-3000:])


ATTACK = r"""
import json, os, random, socket, struct, threading, time
import grpc, numpy as np, ddl
from ddl.core import auth as _auth
from ddl.runtime import runtime as _runtime
from ddl.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc
ddl.init()
r, n = ddl.rank(), ddl.size()
rt = _runtime.runtime()
report = {}

def attack():
    # gRPC on this host's coordinator: no token, a wrong one, another job's
    codes = []
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(rt.config.coordinator_addr))
    other = _auth.grpc_token(_auth.new_secret(), _auth.new_job_id())
    wrong = _auth.grpc_token(_auth.new_secret(), rt.config.job_id)
    for md in ((), ((_auth.GRPC_METADATA_KEY, "x" * 64),), ((_auth.GRPC_METADATA_KEY, other),),
               ((_auth.GRPC_METADATA_KEY, wrong),)):
        try:
            stub.Register(pb.RegisterRequest(rank=0, size=n, job_id=rt.config.job_id),
                          metadata=md, timeout=5)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    report["grpc"] = codes
    # the data port of rank 2, on the other host
    host, port = rt.peers[2].data_address.rsplit(":", 1)
    rng = random.Random(r)
    for k in range(1000):
        s = socket.create_connection((host, int(port)), timeout=5)
        if k % 10 == 0:
            s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))))
        s.close()
    # headers announcing 2^63 bytes: another job's, then this job's (the job id is not
    # secret) with a forged proof; each is dropped after its fixed-size part
    from ddl.dataplane.transports._handshake import VERSION, job_id_bytes
    for name, job in (("other_job", b"\0" * 8), ("forged", job_id_bytes(rt.config.job_id))):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"DDL1" + struct.pack("!HI", VERSION, 1) + job + struct.pack("!Q", 1 << 63) * 4
                  + struct.pack("!Q", 1 << 63) * 64)
        s.settimeout(10)
        got, how = b"", "closed"
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:  # closed with our unread bytes pending
            how = "reset"
        except OSError as exc:
            how = type(exc).__name__  # e.g. a timeout: not dropped
        report[name] = [len(got), how]
        s.close()
    report["attack_done"] = True

t = None
if r == 0:
    t = threading.Thread(target=attack, daemon=True)
    t.start()
exact = True
for step in range(300):
    x = (np.arange(4096, dtype=np.float32) * (r + 1) + step) / 7
    want = sum((np.arange(4096, dtype=np.float32) * (k + 1) + step) / 7 for k in range(n))
    got = ddl.allreduce(x, op=ddl.Sum, name="exact")
    exact &= bool(np.array_equal(got, ddl.allreduce(x, op=ddl.Sum, name="again")))
    exact &= bool(np.allclose(got, want, rtol=1e-6))
    # every rank stops at the same step: when rank 0's attack is over
    done = float(t is not None and not t.is_alive() and step > 50)
    if ddl.allreduce(np.array([done]), op=ddl.Max, name="stop")[0]:
        break
    time.sleep(0.005)
if t is not None:
    t.join(60)
# everyone agrees on how far it got; then a final bit-exact check
report["exact"] = exact
report["final"] = ddl.allreduce(np.array([float(r)]), op=ddl.Sum, name="final").tolist()
print("RESULT " + json.dumps(dict(report, rank=r)), flush=True)
ddl.shutdown()
"""


@pytest.mark.timeout(180)
def test_bad_credentials_and_junk_while_a_two_host_job_runs(hosts, tmp_path):
    script = tmp_path / "attack.py"
    script.write_text(ATTACK)
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    r = ddlrun(["-np", "4", "-H", "ddlh1:2,ddlh2:2", sys.executable, str(script)], env,
               timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = _results(r.stdout)
    assert sorted(got) == [0, 1, 2, 3], r.stdout
    assert got[0]["grpc"] == ["UNAUTHENTICATED"] * 4, got[0]
    # another job: at most the one refusal byte; a forged proof: at most the server's
    # nonce (32 bytes: the server proves nothing before the client has) and a refusal
    # byte; then the connection is closed (or reset, as our unread bytes are pending):
    # dropped at once, not read on
    assert got[0]["attack_done"], got[0]
    for name, most in (("other_job", 1), ("forged", 33)):
        size, how = got[0][name]
        assert size <= most and how in ("closed", "reset"), (name, got[0])
    for d in got.values():
        assert d["exact"] and d["final"] == [6.0], d
    refusals = [ln for ln in r.stderr.splitlines() if "refused an unauthenticated call" in ln]
    assert 1 <= len(refusals) <= 2, refusals  # logged at most once a second
