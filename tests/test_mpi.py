"""MPI starts: plain ``init()`` under mpiexec, ``init(comm=...)``, ``ddlrun --mpi``, two
simulated nodes, the no-mpi4py rendezvous; and the pure parts (launcher detection,
the mpirun command line). CI installs MPICH and mpi4py from PyPI (the ``dev`` extra).
The leak check (conftest) fails a test that leaves a coordinator, segment or file."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

import ddl
from ddl.launcher import _mpirun
from ddl.startup import mpi as _mpi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or not _mpi.mpi4py_available(),
    reason="needs mpiexec and mpi4py on PATH (pip install mpich mpi4py: the dev extra)")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")
           or k.startswith("DDL_TEST")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def _run(argv, timeout=120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=_env(**env), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, cwd=ROOT)


# -- real MPI worlds --------------------------------------------------------------------------

@needs_mpi
@pytest.mark.timeout(180)
def test_mpi_world_plain_split_list_and_missing_rank():
    r = _run([MPIEXEC, "-n", "4", sys.executable, os.path.join(HERE, "_mpi_checks.py")])
    assert r.returncode == 0 and "MPI CHECKS OK" in r.stdout, r.stdout + r.stderr[-3000:]


@needs_mpi
@pytest.mark.timeout(120)
def test_ddlrun_mpi_runs_the_subcomm_example():
    r = _run([sys.executable, "-m", "ddl.launcher.cli", "--mpi", "-np", "4", "--verbose",
              sys.executable, "examples/mpi4py_subcomm.py"])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert re.search(r"ddlrun: mpich launcher: \S*mpi(run|exec) -np 4 ", r.stdout), r.stdout
    for world_rank, (ddl_rank, total) in enumerate([(0, 2), (0, 4), (1, 2), (1, 4)]):
        assert f"COMM_WORLD rank: {world_rank}, ddl rank: {ddl_rank}" in r.stdout
        assert re.search(rf"COMM_WORLD rank {world_rank}: half {world_rank % 2} .* ddl sum "
                         rf"{total}, MPI sum 6 -> OK", r.stdout), r.stdout


NODES = """
import os, sys, json
if os.environ.get("BLOCK_MPI4PY"):
    sys.modules["mpi4py"] = None  # as if it were not installed
import numpy as np, ddl
ddl.init()
r = ddl.rank()
out = dict(rank=r, host=os.environ.get("DDL_HOSTNAME", ""), topo=[ddl.local_rank(),
           ddl.local_size(), ddl.cross_rank(), ddl.cross_size(), ddl.is_homogeneous()],
           sum=ddl.allreduce(np.arange(3.0) + r, op=ddl.Sum, name="a").tolist(),
           gathered=ddl.allgather(np.array([r]), name="g").tolist(),
           rows=bool(np.array_equal(
               ddl.allgather(np.full((3 * r + 1, 5), r, np.int32), name="rows"),
               np.concatenate([np.full((3 * k + 1, 5), k, np.int32)
                               for k in range(ddl.size())]))),
           big=bool(np.array_equal(
               ddl.allreduce(np.arange(100003, dtype=np.float64) * (r + 1), op=ddl.Sum,
                             name="big"),
               np.arange(100003, dtype=np.float64) * sum(range(1, ddl.size() + 1)))),
           enabled=ddl.mpi_enabled(), built=ddl.mpi_built())
print("RESULT " + json.dumps(out), flush=True)
ddl.shutdown()
"""


def _results(stdout: str) -> dict:
    import json
    found = [json.loads(m) for m in re.findall(r"RESULT (\{.*?\})", stdout)]
    return {d["rank"]: d for d in found}


@needs_mpi
@pytest.mark.timeout(120)
def test_two_simulated_nodes_uneven_and_the_rendezvous_without_mpi4py(tmp_path):
    script = tmp_path / "nodes.py"
    script.write_text(NODES)
    # two "hosts" (DDL_HOSTNAME) with 3 and 1 ranks: a relay coordinator and TCP between
    r = _run([MPIEXEC, "-n", "3", "-env", "DDL_HOSTNAME", "nodeA", sys.executable,
              str(script), ":", "-n", "1", "-env", "DDL_HOSTNAME", "nodeB", sys.executable,
              str(script)], DDL_BIND_ADDRESS="127.0.0.1")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = _results(r.stdout)
    assert sorted(got) == [0, 1, 2, 3], r.stdout
    # (local_rank, local_size, cross_rank, cross_size, is_homogeneous) as for -H a:3,b:1
    want = {0: [0, 3, 0, 2, False], 1: [1, 3, 0, 1, False], 2: [2, 3, 0, 1, False],
            3: [0, 1, 1, 2, False]}
    for rank, d in got.items():
        assert d["topo"] == want[rank], (rank, d)
        assert d["sum"] == [6.0, 10.0, 14.0] and d["gathered"] == [0, 1, 2, 3], d
        assert d["enabled"] and d["built"], d
    for d in got.values():
        assert d["rows"] and d["big"], d
    # interleaved hosts (ranks 0, 2 on nodeA; 1, 3 on nodeB), hierarchical at every size
    hosts = []
    for name in ("nodeA", "nodeB", "nodeA", "nodeB"):
        hosts += [":", "-n", "1", "-env", "DDL_HOSTNAME", name, sys.executable, str(script)]
    r = _run([MPIEXEC] + hosts[1:], DDL_BIND_ADDRESS="127.0.0.1",
             DDL_HIERARCHICAL_ALLREDUCE="on", DDL_HIERARCHICAL_ALLGATHER="on")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = _results(r.stdout)
    assert sorted(got) == [0, 1, 2, 3], r.stdout
    for rank, d in got.items():
        assert d["topo"][:2] == [rank // 2, 2] and d["rows"] and d["big"], (rank, d)
        assert d["sum"] == [6.0, 10.0, 14.0] and d["gathered"] == [0, 1, 2, 3], d
    # no mpi4py: one node's ranks meet through a private file, and start one coordinator
    r = _run([MPIEXEC, "-n", "3", sys.executable, str(script)], BLOCK_MPI4PY="1",
             DDL_VERBOSE="1")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = _results(r.stdout)
    assert sorted(got) == [0, 1, 2], r.stdout
    assert all(d["sum"] == [3.0, 6.0, 9.0] and d["enabled"] and not d["built"]
               for d in got.values()), got
    assert len(re.findall(r"leader serving job", r.stderr)) == 1, r.stderr
    # no mpi4py over two "nodes" (told what to do without it: see the detection test):
    # with DDL_RENDEZVOUS_ADDR and the secret, mpiexec's ranks standing in for DDL_RANK
    # and DDL_SIZE, they meet over TCP
    nodes = [MPIEXEC, "-n", "1", "-env", "DDL_HOSTNAME", "nodeA", sys.executable, str(script),
             ":", "-n", "1", "-env", "DDL_HOSTNAME", "nodeB", sys.executable, str(script)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run(nodes, BLOCK_MPI4PY="1", DDL_RENDEZVOUS_ADDR=f"127.0.0.1:{port}",
             DDL_JOB_SECRET=os.urandom(32).hex(), DDL_BIND_ADDRESS="127.0.0.1")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = _results(r.stdout)
    assert sorted(got) == [0, 1], r.stdout
    for rank, d in got.items():
        assert d["topo"] == [0, 1, rank, 2, True] and d["sum"] == [1.0, 3.0, 5.0], d
        assert d["enabled"] and not d["built"] and d["big"], d


# -- no MPI needed ------------------------------------------------------------------------------

def test_launcher_detection_from_the_environment():
    # a job over two nodes without mpi4py: what to do instead, before anything starts
    from ddl.core import config
    from ddl.startup.rendezvous import rendezvous
    two_nodes = _mpi.LauncherEnv("MPICH/Hydra", 1, 2, 0, 1, "pmi-x")
    with pytest.raises(ddl.ConfigError, match=re.escape(
            "needs mpi4py to exchange the job's addresses (with MPI's COMM_WORLD holding "
            "every rank: under srun, --mpi=pmix): pip install mpi4py, or set "
            "DDL_RENDEZVOUS_ADDR=<host of rank 0>:<a free port> and the same DDL_JOB_SECRET "
            "(hex) on every node, or start the job with ddlrun")):
        rendezvous(config.load({}), two_nodes)
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_NAMESPACE": "prterun-vm-123@1"}
    e = _mpi.detect(ompi)
    assert (e.launcher, e.rank, e.size, e.local_rank, e.local_size) == ("Open MPI", 3, 8, 1, 2)
    assert e.job_key == "ompi-prterun-vm-123_1"
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    e = _mpi.detect(hydra)
    assert (e.launcher, e.rank, e.size, e.local_size) == ("MPICH/Hydra", 1, 4, 4)
    assert e.job_key == f"pmi-ppid{os.getppid()}"  # no job id: the per-node launcher
    slurm = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3", "SLURM_JOB_ID": "9",
             "SLURM_STEP_ID": "0"}
    e = _mpi.detect(slurm)
    assert (e.launcher, e.rank, e.size, e.local_rank, e.local_size) == ("Slurm", 5, 7, 1, 3)
    assert e.job_key == "slurm-9.0"
    # a batch script (no job step) is one process; nothing is no launcher
    assert _mpi.detect({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) is None
    assert _mpi.detect({}) is None
    with pytest.raises(ddl.ConfigError) as info:
        _mpi.detect(dict(ompi, OMPI_COMM_WORLD_RANK="three"))
    assert info.value.variable == "OMPI_COMM_WORLD_RANK" and "three" in str(info.value)
    with pytest.raises(ddl.ConfigError, match="SLURM_NODEID=4"):
        _mpi.detect(dict(slurm, SLURM_NODEID="4"))
    with pytest.raises(ddl.ConfigError, match="not a Slurm task list"):
        _mpi.detect(dict(slurm, SLURM_STEP_TASKS_PER_NODE="2(y2)"))


def test_mpirun_command_lines():
    cmd = ["python", "train.py", "--lr", "0.1"]
    names = _mpirun.forwarded_names({"DDL_VERBOSE": "1", "PATH": "/bin", "HOME": "/root",
                                     "PYTHONPATH": "/src", "DDL_JOB_SECRET": "x"})
    assert names == ["DDL_JOB_SECRET", "DDL_VERBOSE", "PATH", "PYTHONPATH"]
    argv = _mpirun.build_argv("/usr/bin/mpirun", "openmpi", 4, "a:2,b:2",
                              '--oversubscribe --map-by "ppr:2:node"', cmd,
                              ["DDL_VERBOSE", "PATH"])
    assert argv == ["/usr/bin/mpirun", "-np", "4", "-H", "a:2,b:2", "-x", "DDL_VERBOSE",
                    "-x", "PATH", "--oversubscribe", "--map-by", "ppr:2:node"] + cmd
    argv = _mpirun.build_argv("mpiexec", "mpich", 2, "", "", cmd, ["PATH"])
    assert argv == ["mpiexec", "-np", "2"] + cmd  # Hydra forwards the environment itself
    assert _mpirun.build_argv("m", "mpich", 4, "a:2,b:2", "", cmd, [])[3:5] == \
        ["-hosts", "a:2,b:2"]
    with pytest.raises(ddl.ConfigError, match="2 slot"):
        _mpirun.build_argv("m", "openmpi", 4, "a:2", "", cmd, [])
    with pytest.raises(ddl.ConfigError, match="cannot be split"):
        _mpirun.build_argv("m", "openmpi", 1, "", '--x "open', cmd, [])


def test_ddlrun_mpi_without_mpirun_and_queries_outside_mpi(tmp_path):
    r = _run([sys.executable, "-m", "ddl.launcher.cli", "--mpi", "-np", "2", "true"],
             timeout=30, PATH=str(tmp_path))
    assert r.returncode == 2 and "--mpi needs mpirun or mpiexec on PATH" in r.stderr, r.stderr
    # a plain process: MPI did not start it
    code = ("import ddl\nddl.init()\nassert not ddl.mpi_enabled()\n"
            "try:\n    ddl.mpi_threads_supported()\nexcept ddl.MPINotEnabledError as e:\n"
            "    print('refused:', e)\nddl.shutdown()\n"
            "try:\n    ddl.mpi_enabled()\nexcept ddl.NotInitializedError:\n"
            "    print('needs init')\n")
    r = _run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "refused: ddl.mpi_threads_supported(): this job was not started by MPI" in r.stdout
    assert "needs init" in r.stdout
