"""ddlrun end to end with real processes: environment, secrets, output, flags, hosts."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from test_launcher_support import ddlrun, job_env, script

import ddl

pytestmark = pytest.mark.timeout(60)

ENV_SCRIPT = r'''
import json, os
secret = os.environ["DDL_JOB_SECRET"]
job = os.environ["DDL_JOB_ID"]
# Every process of this job (found by its environment) and its command line.
seen = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        continue
    if ("DDL_JOB_ID=" + job).encode() in environ or int(pid) == os.getppid():
        seen[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace")
print(json.dumps({
    "env": {k: v for k, v in os.environ.items() if k.startswith("DDL_")},
    "cmdlines": seen,
    "secret_in_cmdline": any(secret in c for c in seen.values()),
    "ppid": os.getppid(),
    "dir_mode": os.stat(os.path.dirname(
        os.environ["DDL_COORDINATOR_ADDR"][len("unix:"):])).st_mode & 0o777,
}))
'''


def _rank_json(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("<stdout>:")
        out[int(prefix.strip("[]"))] = json.loads(rest)
    return out


def test_env_and_secret(tmp_path):
    path = script(tmp_path, "env.py", ENV_SCRIPT)
    jobs = []
    for _ in range(2):
        env = job_env(tmp_path)
        r = ddlrun(["-np", "3", "--tcp-chunk-bytes", "8192", sys.executable, path], env)
        assert r.returncode == 0, r.stderr
        ranks = _rank_json(r.stdout)
        assert sorted(ranks) == [0, 1, 2]
        secrets = set()
        for rank, info in ranks.items():
            e = info["env"]
            assert e["DDL_RANK"] == str(rank) and e["DDL_LOCAL_RANK"] == str(rank)
            assert e["DDL_SIZE"] == "3" and e["DDL_LOCAL_SIZE"] == "3"
            assert e["DDL_COORDINATOR_ADDR"].startswith("unix:")
            assert e["DDL_COORDINATOR_ADDR"].endswith("/coord.sock")
            assert e["DDL_TCP_CHUNK_BYTES"] == "8192"  # flag -> variable
            assert len(e["DDL_JOB_SECRET"]) == 64
            secrets.add(e["DDL_JOB_SECRET"])
            assert not info["secret_in_cmdline"], info["cmdlines"]
            # the coordinator, the other ranks and ddlrun itself were all inspected
            cmdlines = " | ".join(info["cmdlines"].values())
            assert "--address unix:" in cmdlines and "ddl.launcher.cli" in cmdlines
            assert len(info["cmdlines"]) >= 3
        assert len(secrets) == 1, "ranks of one job must share the secret"
        assert len({i["env"]["DDL_COORDINATOR_ADDR"] for i in ranks.values()}) == 1
        assert ranks[0]["dir_mode"] == 0o700
        sock_dir = os.path.dirname(ranks[0]["env"]["DDL_COORDINATOR_ADDR"][len("unix:"):])
        assert not os.path.exists(sock_dir), "the job's temp dir must be removed"
        jobs.append((secrets.pop(), ranks[0]["env"]["DDL_JOB_ID"]))
    assert jobs[0][0] != jobs[1][0] and jobs[0][1] != jobs[1][1]


CHILD_SCRIPT = r'''
import json, multiprocessing, os, subprocess, sys
secret = os.environ["DDL_JOB_SECRET"]
import numpy as np
import ddl  # takes the secret out of the environment, before init()

def env_of_child(q):
    try:
        ddl.rank()
        rank = "no error"
    except ddl.NotInitializedError:  # a forked child is not a rank of the job
        rank = "NotInitializedError"
    q.put([os.environ.get("DDL_JOB_SECRET"), rank])

shell_before = subprocess.run(["sh", "-c", "env"], capture_output=True, text=True).stdout
ddl.init()
total = float(ddl.allreduce(np.array([1.0]), op=ddl.Sum, name="x")[0])
shell_after = subprocess.run(["sh", "-c", "env; cat /proc/$PPID/environ"],
                             capture_output=True, text=True).stdout
forked = multiprocessing.get_context("fork").Queue()
p = multiprocessing.get_context("fork").Process(target=env_of_child, args=(forked,))
p.start(); fork_env = forked.get(timeout=30); p.join(30)
with open("/proc/self/environ", "rb") as f:
    own_block = f.read()
print(json.dumps({
    "total": total, "in_os_environ": "DDL_JOB_SECRET" in os.environ,
    "shell_before": secret in shell_before, "shell_after": secret in shell_after,
    "fork": fork_env, "own_block": secret.encode() in own_block}))
ddl.shutdown()
'''


def test_a_workers_children_do_not_inherit_the_job_secret(tmp_path):
    """import ddl moves DDL_JOB_SECRET out of the environment (and overwrites it in the
    initial environment block that /proc/PID/environ shows): a shell or a forked child of
    a worker cannot see it, and the job still runs. A forked child is no rank: it exits
    at once (it used to hang in the parent's goodbye) and ddl calls in it raise."""
    path = script(tmp_path, "child.py", CHILD_SCRIPT)
    r = ddlrun(["-np", "2", sys.executable, path], job_env(tmp_path))
    assert r.returncode == 0, r.stderr
    ranks = _rank_json(r.stdout)
    assert sorted(ranks) == [0, 1]
    for info in ranks.values():
        assert info == {"total": 2.0, "in_os_environ": False, "shell_before": False,
                        "shell_after": False, "fork": [None, "NotInitializedError"],
                        "own_block": False}, info


OUTPUT_SCRIPT = r'''
import os, sys
r = os.environ["DDL_RANK"]
print("out of", r)
print("err of", r, file=sys.stderr)
sys.stdout.flush()
sys.stdout.buffer.write(b"bad \xff byte\n")
sys.stdout.write("partial " + r)
'''


def test_output_prefixes_and_files(tmp_path):
    path = script(tmp_path, "out.py", OUTPUT_SCRIPT)
    logs = tmp_path / "logs"
    r = ddlrun(["-np", "2", "--output-filename", str(logs), sys.executable, path],
               job_env(tmp_path))
    assert r.returncode == 0, r.stderr
    out, err = r.stdout.splitlines(), r.stderr.splitlines()
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:out of {rank}" in out
        assert f"[{rank}]<stdout>:bad \ufffd byte" in out
        assert f"[{rank}]<stdout>:partial {rank}" in out  # flushed at EOF
        assert f"[{rank}]<stderr>:err of {rank}" in err
        assert (logs / f"rank.{rank}" / "stdout").read_bytes() == (
            f"out of {rank}\nbad \xff byte\npartial {rank}".encode("latin-1"))
        assert (logs / f"rank.{rank}" / "stderr").read_text() == f"err of {rank}\n"
    assert not any("<stdout>" in line for line in err)
    assert not any("<stderr>" in line for line in out)


def test_verbose_logs_commands_without_secret(tmp_path):
    path = script(tmp_path, "s.py", "import os; print(os.environ['DDL_JOB_SECRET'])\n")
    r = ddlrun(["-np", "1", "--verbose", sys.executable, path], job_env(tmp_path))
    assert r.returncode == 0, r.stderr
    secret = r.stdout.split("<stdout>:")[1].strip()
    assert "ddlrun: starting the coordinator:" in r.stderr
    assert "ddlrun: starting rank 0: " in r.stderr and path in r.stderr
    assert secret not in r.stderr
    # a program that never calls ddl.init(): its coordinator is stopped at once (no linger)
    assert "no rank called ddl.init(): stopping the coordinator now" in r.stderr
    path = script(tmp_path, "i.py", "import ddl; ddl.init(); ddl.shutdown()\n")
    r = ddlrun(["-np", "1", "--verbose", sys.executable, path], job_env(tmp_path))
    assert r.returncode == 0 and "no rank called" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, env, needles", [
    (["--start-timeout", "abc"], {}, ["--start-timeout", "DDL_START_TIMEOUT", "abc"]),
    (["--start-timeout", "0"], {}, ["--start-timeout", ">= 0.1"]),
    (["--allreduce-algorithm", "tree"], {}, ["--allreduce-algorithm", "recursive_doubling"]),
    (["--fusion-threshold-mb", "x"], {}, ["--fusion-threshold-mb", "DDL_FUSION_THRESHOLD"]),
    ([], {"DDL_TCP_CHUNK_BYTES": "lots"}, ["DDL_TCP_CHUNK_BYTES", "lots"]),
    ([], {"DDL_FUSION_TRESHOLD": "1"}, ["unknown configuration variable DDL_FUSION_TRESHOLD"]),
    (["-H", "a:1", "--hostfile", "f"], {}, ["-H or --hostfile"]),
    (["--hostfile", "/nonexistent/hosts"], {}, ["--hostfile /nonexistent/hosts"]),
    (["-x", "A-B"], {}, ["-x 'A-B' is not a variable name"]),
    (["-H", "localhost:1"], {}, ["1 slot", "-np is 2"]),
    (["-H", "localhost:zero"], {}, ["-H", "host:slots"]),
])
def test_bad_configuration_exits_2(tmp_path, args, env, needles):
    r = ddlrun(["-np", "2", *args, sys.executable, "-c", "pass"],
               job_env(tmp_path, **env), timeout=20)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddlrun: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0]


def test_missing_np_and_command(tmp_path):
    r = ddlrun([sys.executable, "-c", "pass"], job_env(tmp_path), timeout=20)
    assert r.returncode == 2 and "-np is required" in r.stderr
    r = ddlrun(["-np", "1"], job_env(tmp_path), timeout=20)
    assert r.returncode == 2 and "no command given" in r.stderr


def test_flag_beats_environment_and_local_hosts(tmp_path):
    import socket
    path = script(tmp_path, "e.py", "import os; print(os.environ['DDL_SMALL_MESSAGE_BYTES'])\n")
    env = job_env(tmp_path, DDL_SMALL_MESSAGE_BYTES="100", DDL_NUM_PROC="2")
    r = ddlrun(["-H", f"127.0.0.1:1,{socket.gethostname()}:1", "--small-message-bytes", "7",
                sys.executable, path], env)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0]<stdout>:7", "[1]<stdout>:7"]


def test_hostfile_and_rank_placement(tmp_path):
    from ddl.launcher._hosts import assign, parse_hostfile
    f = tmp_path / "hosts"
    f.write_text("# cluster\nh1 slots=4\nh2:2  # two\n\nh3\nh4 slots=2 max_slots=8\n")
    assert parse_hostfile(str(f)) == [("h1", 4), ("h2", 2), ("h3", 1), ("h4", 2)]
    assert assign(parse_hostfile(str(f)), 6) == [("h1", 4), ("h2", 2)]
    assert assign([("a", 2), ("b", 2), ("a", 1)], 5) == [("a", 3), ("b", 2)]
    f.write_text("h1 cores=4\n")
    with pytest.raises(ddl.ConfigError, match="line 1.*host slots=N"):
        parse_hostfile(str(f))


def test_a_coordinator_started_elsewhere_keeps_a_relative_pythonpath(monkeypatch, tmp_path):
    # coordinators run in their job's directory: PYTHONPATH=vendor (pip install --target
    # vendor) must still name the launcher's vendor/
    from ddl.core.child_env import absolute_pythonpath
    monkeypatch.chdir(tmp_path)
    env = absolute_pythonpath({"PYTHONPATH": os.pathsep.join(["vendor", "", "/abs"]),
                               "HOME": "h"})
    assert env == {"PYTHONPATH": os.pathsep.join([str(tmp_path / "vendor"), str(tmp_path),
                                                  "/abs"]), "HOME": "h"}
    assert absolute_pythonpath({"HOME": "h"}) == {"HOME": "h"}


def test_an_unreachable_host_fails_the_launch_naming_it(tmp_path):
    r = ddlrun(["-np", "2", "-H", "localhost:1,node7.invalid:1", "--start-timeout", "5",
                sys.executable, "-c", "pass"], job_env(tmp_path), timeout=60)
    assert r.returncode == 1, r.stderr
    assert "cannot reach host node7.invalid over ssh" in r.stderr, r.stderr


def test_a_report_relayed_from_another_host(tmp_path):
    """A remote rank's failure report comes back as one stderr line: recorded for its
    rank only, never shown; junk after the marker is dropped."""
    from ddl.core import report as _report
    remote, here = tmp_path / "remote", tmp_path / "here"
    remote.mkdir()
    here.mkdir()
    err = ddl.PeerLostError("allreduce 'x': rank 3 (host h2, pid 7) has shut down", rank=3,
                            host="h2", pid=7)
    _report.write(str(remote), 1, err)
    line = _report.relay_line(str(remote), 1)
    assert line.startswith(_report.REMOTE_PREFIX) and line.endswith(b"\n")
    assert not _report.accept_relayed(str(here), 1, b"ordinary output\n")
    assert _report.accept_relayed(str(here), 2, line)  # another rank's: consumed, not kept
    assert _report.read(str(here), 2) is None
    assert _report.accept_relayed(str(here), 1, line)
    got = _report.read(str(here), 1)
    assert (got.kind, got.origin_rank, got.origin_host) == ("PeerLostError", 3, "h2")
    assert _report.accept_relayed(str(here), 1, _report.REMOTE_PREFIX + b"{not json\n")
    assert _report.relay_line(str(here), 5) is None


def test_the_probe_picks_an_address_every_other_host_reaches():
    from ddl.launcher._probe import Listeners, choose, connects
    order = {"a": ["10.78.0.1", "10.77.0.1"], "b": ["10.77.0.2"], "me": ["10.0.0.9",
                                                                     "10.77.0.254"]}
    reached = {"a": {"b": ["10.77.0.2"], "me": ["10.77.0.254"]},
               "b": {"a": ["10.77.0.1"], "me": ["10.77.0.254"]},
               "me": {"a": ["10.78.0.1", "10.77.0.1"], "b": ["10.77.0.2"]}}
    chosen, error = choose(order, reached)
    assert error is None
    assert chosen == {"a": "10.77.0.1", "b": "10.77.0.2", "me": "10.77.0.254"}
    reached["b"]["a"] = []
    chosen, error = choose(order, reached)
    assert error.startswith("host a cannot be reached from b on any of its addresses "
                            "(10.78.0.1, 10.77.0.1)"), error
    # real sockets: a listener answers, a closed port does not
    listeners = Listeners(["127.0.0.1"])
    try:
        port = listeners.ports["127.0.0.1"]
        got = connects({"x": {"127.0.0.1": port}, "y": {"127.0.0.1": 1}}, timeout=2)
        assert got == {"x": ["127.0.0.1"], "y": []}
    finally:
        listeners.close()


def test_ssh_command_lines_carry_no_job_data():
    from ddl.launcher._ssh import SshOptions, remote_agent_argv
    argv = SshOptions(command="ssh -F 'my config'", port=2222, identity_file="/k/id",
                      connect_timeout=7.5).argv("h1", remote_agent_argv("/venv/bin/python"))
    assert argv[:3] == ["ssh", "-F", "my config"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k/id"
    assert "BatchMode=yes" in argv and "ConnectTimeout=7" in argv and "-T" in argv
    assert argv[-3:] == ["h1", "--", "/venv/bin/python -m ddl.launcher.remote"]
    with pytest.raises(ddl.ConfigError, match="DDL_SSH_COMMAND"):
        SshOptions(command="ssh 'open").argv("h", ["true"])


def test_horovodrun_spellings_bare_switches_and_version(tmp_path):
    """horovodrun's bare switches (``--hierarchical-allreduce`` with no value means on),
    ``--np`` as a long form, ``--version``; the program's own arguments stay its own."""
    from ddl.launcher.cli import _switches
    assert _switches(["-np", "2", "--hierarchical-allreduce", "python", "t.py",
                      "--hierarchical-allreduce"]) == [
        "-np", "2", "--hierarchical-allreduce", "on", "python", "t.py",
        "--hierarchical-allreduce"]
    assert _switches(["--hierarchical-allgather", "off", "--verbose", "x"]) == [
        "--hierarchical-allgather", "off", "--verbose", "x"]
    # the value of a flag is not the command, whatever the flag
    assert _switches(["--config-file", "c.yaml", "--num-nccl-streams", "2",
                      "--hierarchical-allreduce", "python"]) == [
        "--config-file", "c.yaml", "--num-nccl-streams", "2", "--hierarchical-allreduce",
        "on", "python"]
    path = script(tmp_path, "h.py", "import os; print(os.environ['DDL_HIERARCHICAL_ALLREDUCE'],"
                  " os.environ['DDL_HIERARCHICAL_ALLGATHER'])\n")
    r = ddlrun(["--np", "1", "--hierarchical-allreduce", "--hierarchical-allgather",
                sys.executable, path], job_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "[0]<stdout>:on on", r.stdout + r.stderr
    # horovodrun's other spellings: --num-proc, --hosts, the --no- switches, its stall
    # flags' names, and flags ddl has no use for (a note says which, once)
    stall = script(tmp_path, "st.py", "import os; e = os.environ; print(e["
                   "'DDL_HIERARCHICAL_ALLREDUCE'], e['DDL_HIERARCHICAL_ALLGATHER'], e["
                   "'DDL_STALL_CHECK_TIME_SECONDS'], e['DDL_STALL_SHUTDOWN_TIME_SECONDS'])\n")
    r = ddlrun(["--num-proc", "2", "--hosts", "localhost:2", "--no-hierarchical-allreduce",
                "--no-hierarchical-allgather", "--stall-check-warning-time-seconds", "7",
                "--stall-check-shutdown-time-seconds", "9", "--num-nccl-streams", "2",
                "--mpi-threads-disable", "--gloo-timeout-seconds", "60", "--log-with-timestamp",
                sys.executable, stall], job_env(tmp_path))
    assert r.returncode == 0 and sorted(r.stdout.split("\n")[:2]) == [
        f"[{k}]<stdout>:off off 7.0 9.0" for k in (0, 1)], r.stdout + r.stderr
    assert [line for line in r.stderr.splitlines() if "note:" in line] == [
        "ddlrun: note: ignored horovodrun flags (no meaning in ddl): --num-nccl-streams 2, "
        "--gloo-timeout-seconds 60, --mpi-threads-disable, --log-with-timestamp"], r.stderr
    for flag in ("--version", "-v"):
        r = ddlrun([flag], job_env(tmp_path), timeout=20)
        assert r.returncode == 0 and r.stdout.strip() == f"ddlrun (ddl) {ddl.__version__}", r
    r = ddlrun(["-cb"], job_env(tmp_path), timeout=20)
    assert r.returncode == 0 and r.stdout.startswith(f"ddl v{ddl.__version__}:"), r
    # the dev environment has torch and TensorFlow, not MXNet or JAX (their own venvs);
    # NCCL and CUDA IPC as ddl.nccl_built() and ddl.cuda_built() say (no GPU: neither)
    mark = lambda ok: "X" if ok else " "  # noqa: E731
    for line in ("[X] PyTorch", "[X] TensorFlow", "[ ] MXNet", "[X] shared memory",
                 f"[{mark(ddl.nccl_built())}] NCCL", f"[{mark(ddl.cuda_built())}] CUDA IPC"):
        assert f"    {line}" in r.stdout, r.stdout


def test_horovodrun_shorthand_switches(tmp_path):
    """--disable-cache and --no-stall-check set their variables, --cycle-time-ms its own;
    a shorthand that contradicts a flag is an error."""
    path = script(tmp_path, "s.py", "import os; e = os.environ; print(e['DDL_CACHE_CAPACITY'], "
                  "e['DDL_STALL_CHECK_TIME_SECONDS'], e['DDL_STALL_SHUTDOWN_TIME_SECONDS'], "
                  "e['DDL_CYCLE_TIME_MS'])\n")
    r = ddlrun(["-np", "1", "--disable-cache", "--no-stall-check", "--cycle-time-ms", "5",
                sys.executable, path], job_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "[0]<stdout>:0 0.0 0.0 5.0", (
        r.stdout + r.stderr)
    r = ddlrun(["-np", "1", "--prefix-output-with-timestamp", sys.executable, "-c",
                "print('x')"], job_env(tmp_path))
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:x\n",
                        r.stdout), r.stdout
    r = ddlrun(["-np", "1", "--gloo", "--tcp", sys.executable, "-c",
                "import os; print(os.environ['DDL_TRANSPORT'])"], job_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "[0]<stdout>:tcp", r.stdout + r.stderr
    r = ddlrun(["-np", "1", "--disable-cache", "--cache-capacity", "8", sys.executable, path],
               job_env(tmp_path), timeout=20)
    assert r.returncode == 2 and "--disable-cache sets --cache-capacity 0" in r.stderr, r.stderr


def test_horovod_variables_reach_the_ranks_and_ddlrun_says_so_once(tmp_path):
    path = script(tmp_path, "v.py", "import ddl; ddl.init(); "
                  "from ddl.runtime.runtime import runtime; c = runtime().config; "
                  "print(c.fusion_threshold, c.stall_check_time, c.cycle_time_ms); "
                  "ddl.shutdown()\n")
    r = ddlrun(["-np", "2", sys.executable, path],
               job_env(tmp_path, HOROVOD_FUSION_THRESHOLD="4096", HOROVOD_CYCLE_TIME="1",
                       HOROVOD_STALL_CHECK_TIME_SECONDS="7", HOROVOD_GPU_OPERATIONS="NCCL"))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0]<stdout>:4096 7.0 1.0",
                                             "[1]<stdout>:4096 7.0 1.0"]
    note = "ddlrun: note: ignored (no meaning in ddl): HOROVOD_GPU_OPERATIONS"
    assert r.stderr.count(note) == 1, r.stderr
    assert "HOROVOD_GPU_OPERATIONS" not in r.stderr.replace(note, ""), r.stderr


def test_a_horovodrun_config_file(tmp_path):
    """--config-file: flag names as keys and horovodrun's sections; the command line wins;
    an unknown key is an error that suggests the closest setting."""
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("fusion_threshold_mb: 32\ncache_capacity: 2048\nhierarchical_allreduce: "
                   "true\nverbose: 0\ntimeline:\n  filename: " + str(tmp_path / "t.json") +
                   "\n  mark_cycles: true\nstall_check:\n  enabled: false\n")
    path = script(tmp_path, "c.py", "import os; e = os.environ; print(*(e['DDL_' + k] for k in "
                  "('FUSION_THRESHOLD', 'CACHE_CAPACITY', 'HIERARCHICAL_ALLREDUCE', "
                  "'TIMELINE_MARK_CYCLES', 'STALL_SHUTDOWN_TIME_SECONDS')))\n")
    r = ddlrun(["--config-file", str(cfg), "--cache-capacity", "7", "-np", "1",
                sys.executable, path], job_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "[0]<stdout>:33554432 7 on 1 0.0", \
        r.stdout + r.stderr
    cfg.write_text("fusion_treshold_mb: 3\n")
    r = ddlrun(["--config-file", str(cfg), "-np", "1", sys.executable, path],
               job_env(tmp_path), timeout=20)
    assert r.returncode == 2 and ("unknown setting fusion_treshold_mb (did you mean "
                                  "fusion_threshold_mb?)") in r.stderr, r.stderr


def test_ranks_that_all_reject_their_arguments_are_named_together(tmp_path):
    """Every rank exits alike on its own (a bad flag of the program): the summary names
    the lowest rank and the others, not whichever exited first; a lone failure is named
    alone."""
    r = ddlrun(["-np", "3", sys.executable, "-c", "import sys; sys.exit(3)"],
               job_env(tmp_path), timeout=30)
    assert r.returncode == 3, r.stderr
    assert re.search(r"ddlrun: rank 0 \(pid \d+\) exited with code 3 \(as did ranks 1, 2\); "
                     r"the job was stopped", r.stderr), r.stderr
    r = ddlrun(["-np", "3", sys.executable, "-c",
                "import sys, ddl; ddl.init(); sys.exit(3 if ddl.rank() == 1 else 0)"],
               job_env(tmp_path), timeout=30)
    assert re.search(r"ddlrun: rank 1 \(pid \d+\) exited with code 3; the job", r.stderr), \
        r.stderr
