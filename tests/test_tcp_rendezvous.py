"""Start-up without ddlrun (ddl/startup/tcp_rendezvous.py): processes started one
per rank with only environment variables, as Kubernetes pods are (docs/kubernetes.md),
meet at rank 0's address over authenticated TCP. Real processes on this host, each
claiming its own host name (so the job spans "hosts": relay coordinators and the TCP
data plane run, as between pods); the shipped Kubernetes manifest checked against
Kubernetes' schema; and jobs started by torchrun (ddl/startup/torchrun.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys
secret = os.environ["DDL_JOB_SECRET"].encode()
import numpy as np, ddl
ddl.init()
r, n = ddl.rank(), ddl.size()
out = {"rank": r, "size": n, "local": [ddl.local_rank(), ddl.local_size()],
       "cross": [ddl.cross_rank(), ddl.cross_size()]}
out["sum"] = ddl.allreduce(np.arange(1000, dtype=np.float32) + r, op=ddl.Sum, name="s").tolist()[:3]
out["big"] = bool(np.all(ddl.allreduce(np.ones(1 << 18), op=ddl.Sum, name="big") == n))
out["gather"] = ddl.allgather(np.full((r + 1, 2), r), name="g")[:, 0].tolist()
out["bcast"] = int(ddl.broadcast(np.array([r * 10 + 7]), root_rank=n - 1, name="b")[0])
for step in range(10):
    ddl.allreduce(np.array([float(step)]), name="cached")
seen = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if secret in open(f"/proc/{pid}/cmdline", "rb").read():
            seen.append(pid)
    except OSError:
        pass
out["secret_on_cmdline"] = seen
ddl.shutdown()
print("RESULT " + json.dumps(out), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, rank, size, addr, secret, names=("DDL_RANK", "DDL_SIZE"), **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env.update(DDL_TEST_MARKER=uuid.uuid4().hex, DDL_JOB_SECRET=secret,
               DDL_RENDEZVOUS_ADDR=addr, DDL_HOSTNAME=f"pod-{rank}", DDL_START_TIMEOUT="20")
    env.update(zip(names, (str(rank), str(size))))
    env.update(extra)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen([sys.executable, str(script)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs, timeout=90):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def test_pods_meet_by_environment_alone(tmp_path):
    size, secret = 3, os.urandom(32).hex()
    addr = f"127.0.0.1:{_free_port()}"
    # pods start in any order: the others wait for rank 0
    procs = [_start(tmp_path, r, size, addr, secret) for r in (2, 1)]
    time.sleep(1.0)
    procs.append(_start(tmp_path, 0, size, addr, secret))
    results = {}
    for code, out, err in _finish(procs):
        assert code == 0, err[-3000:]
        line = next(l for l in out.splitlines() if l.startswith("RESULT "))
        res = json.loads(line[len("RESULT "):])
        results[res["rank"]] = res
    assert sorted(results) == [0, 1, 2]
    for r, res in results.items():
        assert res["size"] == 3
        assert res["local"] == [0, 1] and res["cross"] == [r, 3]  # one rank per "host"
        assert res["sum"] == [3.0, 6.0, 9.0]
        assert res["big"] is True
        assert res["gather"] == [0, 1, 1, 2, 2, 2]
        assert res["bcast"] == 27
        assert res["secret_on_cmdline"] == []


def test_wrong_secret_and_missing_variables_are_named(tmp_path):
    addr = f"127.0.0.1:{_free_port()}"
    secret = os.urandom(32).hex()
    root = _start(tmp_path, 0, 2, addr, secret, DDL_START_TIMEOUT="4")
    time.sleep(0.5)
    stranger = _start(tmp_path, 1, 2, addr, os.urandom(32).hex(), DDL_START_TIMEOUT="4")
    (code0, _, err0), (code1, _, err1) = _finish([root, stranger], timeout=60)
    assert code1 != 0 and "refused rank 1: the two have different DDL_JOB_SECRET" in err1, err1[-2000:]
    assert code0 != 0 and "for ranks [1] of 2" in err0 and "DDLTimeoutError" in err0, err0[-2000:]
    # no rank 0 at all: the dialing rank names the address it waited for
    lonely = _start(tmp_path, 1, 2, f"127.0.0.1:{_free_port()}", secret, DDL_START_TIMEOUT="2")
    (code, _, err), = _finish([lonely], timeout=60)
    assert code != 0 and "could not join rank 0 at DDL_RENDEZVOUS_ADDR=127.0.0.1:" in err, err
    # a variable missing or wrong: a ConfigError naming it, before any connection
    for extra, needle in (({"DDL_SIZE": ""}, "DDL_SIZE"),
                          ({"DDL_RENDEZVOUS_ADDR": "no-port"}, "DDL_RENDEZVOUS_ADDR='no-port'"),
                          ({"DDL_RANK": "5"}, "DDL_RANK=5 is not below DDL_SIZE=2")):
        p = _start(tmp_path, 1, 2, addr, secret, **extra)
        (code, _, err), = _finish([p], timeout=60)
        assert code != 0 and needle in err and "ConfigError" in err, err[-2000:]


def test_kubernetes_manifest_is_valid_and_uses_the_contract():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the "
                             "dev extras (pip install -e '.[dev]')")
    import yaml
    from ddl.core import config
    path = os.path.join(ROOT, "deploy", "kubernetes", "ddl-job.yaml")
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Job", "Service"], kinds  # the Secret is made with kubectl, never committed
    for doc in docs:
        kv.validate(doc, "1.33", strict=True)
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    known = {v.name for v in config.VARIABLES}
    assert {n for n in env if n.startswith("DDL_")} <= known
    for needed in ("DDL_RANK", "DDL_SIZE", "DDL_JOB_SECRET", "DDL_RENDEZVOUS_ADDR"):
        assert needed in env, needed
    assert "secretKeyRef" in env["DDL_JOB_SECRET"]["valueFrom"]  # never a literal
    assert "job-completion-index" in json.dumps(env["DDL_RANK"])
    assert int(env["DDL_SIZE"]["value"]) == job["spec"]["completions"] == job["spec"]["parallelism"]


# -- torchrun as the launcher (ddl/startup/torchrun.py) ------------------------------------

TORCHRUN_WORKER = r"""
import json, os, sys
import numpy as np, ddl
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ddl.init()
if restart == 0 and os.environ.get("FAIL_FIRST") and ddl.rank() == 1:
    os._exit(3)   # torchrun stops the other worker and starts both again
torchrun = [int(os.environ[k])
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
out = {"torchrun": torchrun, "ddl": [ddl.rank(), ddl.size(), ddl.local_rank(), ddl.local_size()],
       "restart": restart, "mpi": ddl.mpi_enabled(),
       "sum": ddl.allreduce(np.full(3, ddl.rank() + 1.0), op=ddl.Sum, name="s").tolist()}
ddl.shutdown()
print("RESULT " + json.dumps(out), flush=True)
"""


def _torchrun(tmp_path, args, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env.update(DDL_TEST_MARKER=uuid.uuid4().hex, DDL_START_TIMEOUT="20", **extra)
    script = tmp_path / "torchrun_worker.py"
    script.write_text(TORCHRUN_WORKER)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(script)],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _results(outs) -> dict:
    results = {}
    for code, out, err in outs:
        assert code == 0, err[-3000:]
        for line in out.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                results[res["ddl"][0]] = res
    return results


def test_torchrun_starts_a_job_on_one_node_and_over_two(tmp_path):
    """``torchrun --nproc-per-node 2`` runs a ddl script as it is: ddl's ranks are
    torchrun's, MPI takes no part, and torchrun's restart (rank 1 fails the first
    attempt) is a new job. Over two "nodes" (two torchruns, each its own host name),
    the ranks meet at DDL_RENDEZVOUS_ADDR with the job secret, or, under torchrun's
    dynamic rendezvous, at the port rank 0 published in torchrun's store; without the
    secret, every rank is told what to set."""
    pytest.importorskip("torch", reason="torchrun comes with torch")
    one = _torchrun(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1",
                               "--master-port", str(_free_port())], FAIL_FIRST="1")
    results = _results(_finish([one]))
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert res["ddl"] == res["torchrun"] and res["torchrun"][1:] == [2, res["ddl"][0], 2]
        assert res["restart"] == 1 and res["mpi"] is False and res["sum"] == [3.0] * 3, res

    master, secret = str(_free_port()), os.urandom(32).hex()
    rendezvous = f"127.0.0.1:{_free_port()}"

    def node(n, **extra):
        return _torchrun(tmp_path, ["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node",
                                    "1", "--master-addr", "127.0.0.1", "--master-port", master],
                         DDL_HOSTNAME=f"node{n}", **extra)
    results = _results(_finish([node(n, DDL_JOB_SECRET=secret, DDL_RENDEZVOUS_ADDR=rendezvous)
                                for n in (0, 1)]))
    assert sorted(results) == [0, 1], results
    for r, res in results.items():
        assert res["ddl"] == res["torchrun"] == [r, 2, 0, 1] and res["sum"] == [3.0] * 3, res
    # torch.distributed's RANK and WORLD_SIZE without torchrun (a Kubeflow PyTorchJob's
    # pods) stand in for DDL_RANK and DDL_SIZE
    addr = f"127.0.0.1:{_free_port()}"
    pods = [_start(tmp_path, r, 2, addr, secret, names=("RANK", "WORLD_SIZE")) for r in (0, 1)]
    for code, out, err in _finish(pods):
        assert code == 0 and '"size": 2' in out and '"sum": [1.0, 3.0, 5.0]' in out, err[-3000:]
    # torchrun's dynamic rendezvous (c10d): which node holds rank 0 is not known in
    # advance; with the secret alone, rank 0 publishes its port in torchrun's store
    endpoint = f"127.0.0.1:{_free_port()}"

    def elastic_node(n, procs, **extra):
        return _torchrun(tmp_path, ["--nnodes", "2", "--nproc-per-node", str(procs),
                                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                                    "--rdzv-id", "job"],
                         DDL_HOSTNAME=f"elastic{n}", **extra)
    results = _results(_finish([elastic_node(0, 2, DDL_JOB_SECRET=secret),
                                elastic_node(1, 1, DDL_JOB_SECRET=secret)]))
    assert sorted(results) == [0, 1, 2], results
    for r, res in results.items():   # a node's ranks are its own: ddl's local ranks too
        assert res["ddl"] == res["torchrun"] and res["sum"] == [6.0] * 3, res
    assert sorted(res["ddl"][3] for res in results.values()) == [1, 2, 2], results
    # without the secret every rank says what to set: the secret alone, since torchrun's
    # store carries the address
    master = str(_free_port())
    for code, _, err in _finish([node(n) for n in (0, 1)]):
        assert code != 0 and ("ConfigError: ddl.init() under torchrun: the job has 2 ranks on "
                              "2 nodes (LOCAL_WORLD_SIZE=1), and ranks on different nodes prove "
                              "a shared secret to each other: set the same DDL_JOB_SECRET on "
                              "every node") in err, err[-3000:]


def test_torchrun_variables_are_read_strictly():
    from ddl.core.errors import ConfigError
    from ddl.startup import torchrun
    env = {"TORCHELASTIC_RUN_ID": "r", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    found = torchrun.detect(env)
    assert (found.launcher, found.rank, found.size, found.local_rank, found.local_size,
            found.mpi) == ("torchrun", 3, 4, 1, 2, False)
    assert torchrun.detect({k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}) is None
    for bad, message in [({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' (set by torchrun) is not a "
                                               "non-negative integer"),
                         ({"RANK": "\u00b2"}, "RANK='\u00b2' (set by torchrun) is not a "
                                                "non-negative integer"),
                         ({"RANK": "4"}, "RANK=4 (set by torchrun) is not below WORLD_SIZE=4"),
                         ({"WORLD_SIZE": "0", "RANK": "0"}, "RANK=0 (set by torchrun) is not "
                                                            "below WORLD_SIZE=0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            torchrun.detect(dict(env, **bad))
    # DDL_RANK or DDL_SIZE against the launcher's: named, not silently taken
    from ddl.core import config
    from ddl.startup import bootstrap
    with pytest.raises(ConfigError, match=re.escape("DDL_SIZE=1 but torchrun says 4: unset "
                                                    "DDL_SIZE")):
        bootstrap.over_tcp(config.load({"DDL_RENDEZVOUS_ADDR": "127.0.0.1:1", "DDL_SIZE": "1",
                                        "DDL_JOB_SECRET": "ab" * 32}), found)
    # the workers of one torchrun share a key whatever their parent; a restart gets another
    key = found.job_key
    assert torchrun.detect(dict(env, RANK="2")).job_key == key
    assert torchrun.detect(dict(env, TORCHELASTIC_RESTART_COUNT="1")).job_key != key
    with pytest.raises(ConfigError, match="set DDL_RENDEZVOUS_ADDR=<host of rank 0>:<a free "
                                          "port>"):
        torchrun.check_one_node(found, {})
    torchrun.check_one_node(torchrun.detect(dict(env, WORLD_SIZE="2", RANK="1")), {})
    # torch.distributed's variables alone: where the ranks meet is asked for, not guessed
    plain = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0"}
    found = torchrun.detect_env(plain)
    assert torchrun.detect(plain) is None and (found.rank, found.size, found.mpi) == (1, 4, False)
    with pytest.raises(ConfigError, match=re.escape(
            "RANK=1 and WORLD_SIZE=4 are set (torch.distributed's env:// start-up, e.g. a "
            "Kubeflow PyTorchJob), but not where the ranks meet: set "
            "DDL_RENDEZVOUS_ADDR=job-master-0:<a free port> and the same DDL_JOB_SECRET on "
            "every rank, or start the job with ddlrun or torchrun")):
        torchrun.check_one_node(found, plain)
    assert torchrun.detect_env({"RANK": "0"}) is None


def test_torchrun_store_rendezvous_is_bounded_and_checked():
    """Rank 0's port through torchrun's store (a real torch TCPStore standing for the
    agent's): rank 0 publishes what it listens on; another rank reads it, waits at most
    until its deadline for a rank 0 that never publishes (a named timeout), and refuses
    a value that is no port; torch.distributed's bare variables never use the store."""
    pytest.importorskip("torch", reason="torchrun's store is torch's TCPStore")
    import time
    from datetime import timedelta
    from torch.distributed import TCPStore
    from ddl.core.errors import BootstrapError, DDLTimeoutError
    from ddl.startup import torchrun
    port = _free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                     wait_for_workers=False)
    env = {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1"}
    found = torchrun.detect(env)
    assert torchrun.meets_through_store(found, "ab" * 32, env)
    assert not torchrun.meets_through_store(found, "", env)       # the secret is needed
    assert not torchrun.meets_through_store(found, "ab" * 32, dict(
        env, TORCHELASTIC_USE_AGENT_STORE="False"))
    assert not torchrun.meets_through_store(torchrun.detect_env(env), "ab" * 32, env)
    t0 = time.monotonic()
    with pytest.raises(DDLTimeoutError, match=re.escape(
            f"rank 1 waited 1.5 s (DDL_START_TIMEOUT) for rank 0's port in torchrun's store "
            f"at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} (key "
            f"'ddl/rendezvous-port/r1/2'): rank 0 has not started ddl.init")):
        torchrun.rendezvous_through_store(1, time.monotonic() + 1.5, 1.5, env)
    assert time.monotonic() - t0 < 5
    addr, announce = torchrun.rendezvous_through_store(0, time.monotonic() + 5, 5, env)
    assert addr == "127.0.0.1:0"
    announce(4321)
    assert agent.get("ddl/rendezvous-port/r1/2") == b"4321"
    assert torchrun.rendezvous_through_store(1, time.monotonic() + 5, 5, env) == \
        ("127.0.0.1:4321", None)
    agent.set("ddl/rendezvous-port/r1/2", "70000")
    with pytest.raises(BootstrapError, match="read '70000' as rank 0's port"):
        torchrun.rendezvous_through_store(1, time.monotonic() + 5, 5, env)
