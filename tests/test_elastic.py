"""Elastic jobs on this machine (ddlrun --min-np/--max-np), with real processes.

Two simulated hosts, ``localhost`` and ``127.0.0.1`` (both this machine, so each gets its
own coordinator and shared-memory domain, and TCP between them). The training program is
tests/_elastic_worker.py: every step allreduces a vector that depends on the step and
the rank, and commits; a reference built from the committed schedule of world sizes
checks that each change rolled back to the last commit and lost nothing before it.
Jobs across real hosts (network namespaces) are in test_elastic_hosts.py.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import threading
import time
import subprocess
import sys

import numpy as np
import pytest
from test_launcher_support import ddlrun, job_env, marked_pids

from ddl.core.errors import ConfigError
from ddl.launcher.elastic.discovery import Blacklist, Discovery, parse, parse_cooldown

pytestmark = pytest.mark.timeout(120)
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_elastic_worker.py")


def reference(schedule) -> np.ndarray:
    w = np.zeros(4)
    for step, size in enumerate(schedule):
        w += sum(np.arange(4) * (step + 1) + 10.0 * r for r in range(size))
    return w


def _lines(stdout: str) -> dict:
    results, events = {}, []
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("<stdout>:")
        if not rest.startswith("{"):
            continue
        item = json.loads(rest)
        (events if "event" in item else results.setdefault(item["worker"], [])).append(item)
    return {w: r[-1] for w, r in results.items()}, events


def _run(tmp_path, args, timeout=90, **env):
    e = job_env(tmp_path, **{k: str(v) for k, v in env.items()})
    r = ddlrun(args + [sys.executable, WORKER], e, timeout=timeout)
    assert not marked_pids(e["DDL_TEST_MARKER"]), "a process of the job outlived ddlrun"
    return r


def test_a_killed_and_a_frozen_rank_the_others_go_on_from_the_last_commit(tmp_path):
    """4 workers on 2 hosts; worker 3 is killed before step 4, worker 1 stops itself
    (SIGSTOP) before step 9: the job goes on with 3, then 2, and each world starts from
    the last commit. A forged connection to the rendezvous is refused meanwhile. The
    first world's training loop takes 1.5 s to let go as it fails, which the survivors'
    rollback warning says."""
    r = _run(tmp_path, ["-H", "localhost:2,127.0.0.1:2", "--min-np", "2", "--max-np", "4"],
             STEPS=14, EVENTS="3:4:SIGKILL,1:9:SIGSTOP", FORGE=0, SLOW_UNWIND=1.5)
    assert r.returncode == 0, r.stderr
    results, events = _lines(r.stdout)
    assert sorted(results) == [0, 2], (r.stdout, r.stderr)
    for worker, res in results.items():
        assert res["schedule"] == [4] * 4 + [3] * 5 + [2] * 5, res
        np.testing.assert_allclose(res["w"], reference(res["schedule"]))
        assert res["size"] == 2
        # when each later world got going, after the event that ended the one before
        resumed = [t for t, _ in res["resumed"]]
        assert len(resumed) == 2 and [s for _, s in res["resumed"]] == [3, 2]
        for event, t in zip(sorted(events, key=lambda e: e["at"]), resumed):
            assert 0 < t - event["at"] < 20, (event, t)
    assert results[0]["forged"] == "refused,closed"
    assert results[0]["rank"] == 0 and results[2]["rank"] == 1
    log = r.stderr
    assert "world 1: 3 workers (0@localhost, 1@localhost, 2@127.0.0.1)" in log, log
    assert re.search(r"worker 3 \(host 127.0.0.1, pid \d+\) was killed by signal 9", log)
    assert re.search(r"worker 1 \(host localhost, pid \d+\) \(rank 1 of world 1\) was lost",
                     log), log
    assert "world 2: 2 workers (0@localhost, 2@127.0.0.1)" in log
    assert "refused a connection to the elastic rendezvous" not in log  # not without -v
    assert re.search(r"rolling back to the last commit \(it took 1\.\d s to come out of the "
                     r"training function, which the next world waited for", log), log


def test_the_leaders_coordinator_stopped_then_its_worker_killed(tmp_path):
    """Worker 0 (rank 0) started the leader coordinator. Before step 3 it sends that
    coordinator SIGTERM: the coordinator tells every rank the job is shutting down, which
    ends the world, not the job: the same 4 workers form the next. Before step 6 worker 0
    is killed (Horovod's single rank failure, exit mode 'kill'): its coordinator dies with
    it, every survivor hears that rank 0 was lost, and worker 1, on its host, goes on
    with the other host's two."""
    r = _run(tmp_path, ["-H", "localhost:2,127.0.0.1:2", "--min-np", "2", "--max-np", "4"],
             STEPS=10, EVENTS="0:3:coordinator=SIGTERM,0:6:SIGKILL+held")
    assert r.returncode == 0, r.stderr
    results, _ = _lines(r.stdout)
    assert sorted(results) == [1, 2, 3], (r.stdout, r.stderr)
    for res in results.values():
        assert res["schedule"] == [4] * 6 + [3] * 4, res
        np.testing.assert_allclose(res["w"], reference(res["schedule"]))
    log = r.stderr
    assert "world 1: 4 workers (0@localhost, 1@localhost, 2@127.0.0.1, 3@127.0.0.1)" in log
    assert "world 2: 3 workers (1@localhost, 2@127.0.0.1, 3@127.0.0.1)" in log, log
    assert re.search(r"ShutdownError: the coordinator of host localhost \(pid \d+\) "
                     r"received SIGTERM; the job is shutting down; rolling back to the last "
                     r"commit \(a coordinator of this world stopped, which ends the world, "
                     r"not the job\)", log), log
    # the kill (a child of the killed worker holds its sockets open a while, so that
    # its coordinator's parent-death signal comes before the leader sees the stream
    # close): the survivors learn that rank 0 was lost, not that the job is shutting
    # down (which ddlrun blamed on a survivor)
    world1 = log[log.index("world 1: 4 workers"):]
    assert re.search(r"PeerLostError: rank 0 \(host localhost, pid \d+\) was lost", world1), log
    assert "ShutdownError" not in world1, log


def test_a_lost_workers_place_is_taken_on_a_free_slot_of_another_host(tmp_path):
    """-np 2 starts both workers on localhost; worker 1 raises an exception before step
    4 and exits (slowly, after ddl's goodbye), so localhost is blacklisted and one worker
    remains, fewer than --min-np 2. The log says how worker 1 ended, though worker 0
    reports it lost first. 127.0.0.1 has two free slots: ddlrun starts workers there (up
    to --max-np) for the next world instead of waiting --elastic-timeout for hosts to
    bring more. When no worker of the ended world is left to hold the committed state,
    none is started."""
    r = _run(tmp_path, ["-np", "2", "-H", "localhost:2,127.0.0.1:2", "--min-np", "2",
                        "--elastic-timeout", "20"], STEPS=8, EVENTS="1:4:raise")
    assert r.returncode == 0, r.stderr
    assert re.search(r"worker 1 \(host localhost, pid \d+\) exited with code 1; host "
                     r"localhost gets no new worker", r.stderr), r.stderr
    assert "RuntimeError: worker 1 fails before step 4" in r.stderr, r.stderr
    assert "stopping it" not in r.stderr, r.stderr   # not killed as it was leaving
    results, _ = _lines(r.stdout)
    assert sorted(results) == [0, 2, 3], (r.stdout, r.stderr)
    for res in results.values():
        assert res["schedule"] == [2] * 4 + [3] * 4, res
        np.testing.assert_allclose(res["w"], reference(res["schedule"]))
    assert "world 1: 3 workers (0@localhost, 2@127.0.0.1, 3@127.0.0.1)" in r.stderr, r.stderr
    # both killed: no worker holds the committed state, so none is started for a world
    # that would begin again from the first step, and the job ends at once (as
    # horovodrun's, when all its workers failed), not after --elastic-timeout
    t0 = time.monotonic()
    r = _run(tmp_path, ["-np", "2", "-H", "localhost:2,127.0.0.1:2", "--min-np", "2",
                        "--elastic-timeout", "60"], STEPS=8, EVENTS="0:4:SIGKILL,1:4:SIGKILL")
    assert r.returncode == 1, r.stderr
    assert re.search(r"ddlrun: every worker has exited, so none holds the committed state "
                     r"and no world can form; the last loss: worker [01] \(host localhost, "
                     r"pid \d+\) was killed by signal 9", r.stderr), r.stderr
    assert "world 1:" not in r.stderr and "waits:" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def test_device_arrays_go_on_after_a_killed_rank(tmp_path):
    """CuPy arrays (the CuPy stand-in of tests/standin), 4 workers on 2 hosts of 2 peer
    GPUs each (one flat NCCL communicator); worker 3 is killed before step 4: the job
    goes on with 3 from the last commit, its new world agreeing a new device plan and
    communicator, and the old world's device segments and communicators are released."""
    standin = os.path.join(HERE, "standin")
    try:
        r = _run(tmp_path, ["-H", "localhost:2,127.0.0.1:2", "--min-np", "2",
                            "--max-np", "4"], STEPS=8, EVENTS="3:4:SIGKILL", CUPY=1,
                 DDL_TEST_GPUS=2, DDL_TEST_PEER_ACCESS=1,
                 PYTHONPATH=os.pathsep.join(p for p in (standin, os.environ.get(
                     "PYTHONPATH")) if p))
        assert r.returncode == 0, r.stderr
        results, _ = _lines(r.stdout)
        assert sorted(results) == [0, 1, 2], (r.stdout, r.stderr)
        for res in results.values():
            assert res["schedule"] == [4] * 4 + [3] * 4, res
            np.testing.assert_allclose(res["w"], reference(res["schedule"]))
            assert res["device"] == ["nccl"], res
    finally:   # the killed worker's NCCL stand-in files (a dead process's GPU state dies
        for name in os.listdir("/dev/shm"):   # with it)
            if name.startswith("ddl-standin-nccl-" + os.environ["DDLTEST_SESSION"]):
                os.unlink(os.path.join("/dev/shm", name))


def test_discovery_grows_the_job_then_the_leaders_host_leaves(tmp_path):
    """The discovery script lists localhost:2; rank 0 adds 127.0.0.1:2 before step 3 (the
    job grows to 4 at the next commit after ddlrun sees it), then drops localhost, rank
    0's host, before step 12: the workers there are released and the two on 127.0.0.1
    form a world whose rank 0 (and leader coordinator) is there."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    r = _run(tmp_path, ["--min-np", "2", "--max-np", "4", "--host-discovery-script",
                        str(discover)], STEPS=24, STEP_SLEEP=0.3, HOSTS_FILE=hosts,
             EVENTS="0:3:hosts=localhost:2;127.0.0.1:2,0:12:hosts=127.0.0.1:2")
    assert r.returncode == 0, r.stderr
    results, _ = _lines(r.stdout)
    assert sorted(results) == [2, 3], (r.stdout, r.stderr)
    for res in results.values():
        schedule = res["schedule"]
        grew, shrank = schedule.index(4), len(schedule) - schedule[::-1].index(4)
        assert schedule == [2] * grew + [4] * (shrank - grew) + [2] * (24 - shrank), schedule
        # ddlrun runs the script every second, and the change comes at the next commit
        assert 3 <= grew <= 11 and 12 <= shrank <= 22, schedule
        np.testing.assert_allclose(res["w"], reference(schedule))
        assert res["host"] == "127.0.0.1" and res["size"] == 2
    assert {results[2]["rank"], results[3]["rank"]} == {0, 1}
    log = r.stderr
    assert "world 1: 4 workers (0@localhost, 1@localhost, 2@127.0.0.1, 3@127.0.0.1)" in log
    assert "host(s) localhost left: 2 worker(s) released" in log
    assert "world 2: 2 workers (2@127.0.0.1, 3@127.0.0.1)" in log
    assert log.count("leaves the job: ddlrun released it") == 2


def test_a_worker_started_as_the_job_finishes_is_told_to_exit_and_the_job_succeeds(
        tmp_path):
    """Rank 0 lists 127.0.0.1 after its last commit (no commit can see the change);
    ddlrun starts a worker there while the two on localhost wind down (2 s). The newcomer (slow to start) joins after the job
    finished: told to exit, it exits 0, which is no failure (a cooldown that ends at the
    end of a job does this, as in Horovod's blacklist backoff scenario)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    r = _run(tmp_path, ["--min-np", "2", "--max-np", "3", "--host-discovery-script",
                        str(discover), "--verbose"], STEPS=6, HOSTS_FILE=hosts,
             EVENTS="0:6:hosts=localhost:2;127.0.0.1:1", END_SLEEP=2, LATE_START="2:3")
    assert r.returncode == 0, r.stderr
    assert re.search(r"started worker 2 on host 127.0.0.1", r.stderr), r.stderr
    results, _ = _lines(r.stdout)
    assert sorted(results) == [0, 1], (r.stdout, r.stderr)


@pytest.mark.parametrize("cooldown", [False, True])
def test_fewer_than_min_np_ends_the_job_naming_why(tmp_path, cooldown):
    """Without a way to get workers back, at once; with a blacklist that ends (a host
    may come back), after --elastic-timeout."""
    extra = ["--blacklist-cooldown-range", "100", "200"] if cooldown else []
    r = _run(tmp_path, ["-np", "3", "--min-np", "3", "--elastic-timeout", "4"] + extra,
             EVENTS="2:2:SIGKILL")
    assert r.returncode == 1, r.stderr
    if cooldown:   # the wait is said while it lasts (after 2 s), not only at its end
        assert re.search(r"ddlrun: world 1 waits: 2 worker\(s\) remain, fewer than --min-np "
                         r"3; waiting up to 4 s \(--elastic-timeout\) for hosts to bring "
                         r"more \(blacklisted: localhost\); the last loss: worker 2 ",
                         r.stderr), r.stderr
        why = ("fewer than --min-np 3 workers remain (2) and no host brought more within "
               "--elastic-timeout 4 s (blacklisted: localhost)")
    else:
        why = re.search(r"fewer than --min-np 3 workers remain \(2\) and no host can bring "
                        r"more \(no --host-discovery-script, and the hosts blacklisted for "
                        r"the rest of the job: localhost\); the last loss: worker 2 \(host "
                        r"localhost, pid \d+\) was killed by signal 9 \(SIGKILL\)",
                        r.stderr).group(0)
    assert f"ddlrun: {why}" in r.stderr
    # every survivor raised it by name
    assert r.stderr.count(f"NotEnoughRanksError: {why}") == 2, r.stderr


def test_a_workers_start_is_bounded_by_start_timeout_not_elastic_timeout(tmp_path):
    """--elastic-timeout bounds a change (horovodrun's bounds the wait for hosts): with
    0.1 s the workers still have --start-timeout to start Python and join world 0. A
    worker that never joins ends the job once --start-timeout has passed, named so."""
    r = _run(tmp_path, ["-np", "2", "--min-np", "2", "--elastic-timeout", "0.1"], STEPS=3)
    assert r.returncode == 0, r.stderr
    assert sorted(_lines(r.stdout)[0]) == [0, 1], (r.stdout, r.stderr)
    env = job_env(tmp_path)
    started = time.monotonic()
    done = ddlrun(["-np", "1", "--min-np", "1", "--elastic-timeout", "0.1", "--start-timeout",
                   "3", "sleep", "60"], env, timeout=30)
    assert done.returncode == 1 and 3 <= time.monotonic() - started < 20, done.stderr
    assert re.search(r"ddlrun: the workers could not form world 0 within --elastic-timeout "
                     r"0.1 s: waited for worker 0 \(host localhost, pid \d+\) \(never joined: "
                     r"--start-timeout 3 s\)", done.stderr), done.stderr
    assert not marked_pids(env["DDL_TEST_MARKER"])


def test_reset_limit_and_the_command_line(tmp_path):
    r = _run(tmp_path, ["-np", "2", "--min-np", "1", "--reset-limit", "0"],
             EVENTS="1:2:SIGKILL")
    assert r.returncode == 1
    assert "ddlrun: the workers changed 1 times, more than --reset-limit 0" in r.stderr
    env = job_env(tmp_path)
    for args, message in [
            (["-np", "2", "--min-np", "3"], "--min-np <= -np <= --max-np; got 3, 2, 3"),
            (["--min-np", "3", "-H", "localhost:1,127.0.0.1:1"],
             "the hosts have 2 slot(s), fewer than the 3 workers asked for"),
            (["--min-np", "1", "--host-discovery-script", "x", "-H", "a:1"],
             "give --host-discovery-script or -H/--hostfile, not both"),
            (["--min-np", "1", "--mpi"], "cannot run under --mpi"),
            (["--min-np", "1", "--blacklist-cooldown-range", "5", "1"],
             "--blacklist-cooldown-range '5,1': expected two numbers")]:
        done = ddlrun(args + ["true"], env)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_discovery_output_and_blacklist_cooldowns(tmp_path):
    assert parse("a:2\n\n# comment\nb\na:1  # more\n", 3, "s") == {"a": 3, "b": 3}
    with pytest.raises(ConfigError, match=r"s line 2: 'b:0' is not host:slots"):
        parse("a\nb:0\n", 1, "s")
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho h1:2\n")
    script.chmod(0o755)
    d = Discovery(str(script), 1)
    assert d.find() == {"h1": 2} and d.problem == ""
    script.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    assert d.find() == {"h1": 2} and "exited with code 3: broken" in d.problem
    assert parse_cooldown("") is None and parse_cooldown("10 100") == (10.0, 100.0)
    forever, cooling = Blacklist(), Blacklist((10.0, 25.0))
    assert forever.fail("a", 0.0) == float("inf") and not forever.allowed("a", 1e9)
    first = cooling.fail("a", 0.0)
    assert 10 <= first <= 11 and not cooling.allowed("a", 9.9) and cooling.allowed("a", 11.1)
    assert 20 <= cooling.fail("a", 100.0) <= 22 and 25 <= cooling.fail("a", 200.0) <= 27.5
    assert cooling.hosts(201.0) == ["a"] and cooling.hosts(300.0) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_ddlrun_stopped_takes_every_worker_and_coordinator_down(tmp_path, signum):
    env = job_env(tmp_path, STEPS="100000", STEP_SLEEP="0.05")
    proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher.cli", "-H",
                             "localhost:1,127.0.0.1:2", "--min-np", "2", sys.executable,
                             WORKER], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: "queue.SimpleQueue[str]" = queue.SimpleQueue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    try:
        while not lines.get(timeout=60).startswith("ddlrun: world 0: 3 workers"):
            pass
        deadline = time.monotonic() + 30  # ddlrun, 3 workers, the 2 coordinators they start
        while len(marked_pids(env["DDL_TEST_MARKER"])) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(marked_pids(env["DDL_TEST_MARKER"])) == 6
        proc.send_signal(signum)
        proc.wait(timeout=30)
        reader.join(10)
        rest = "".join(lines.get() for _ in range(lines.qsize()))
    finally:
        proc.kill()
    if signum == signal.SIGTERM:
        assert proc.returncode == 128 + signum, rest
        assert f"ddlrun: stopped by signal {int(signum)}; every worker was stopped" in rest
    deadline = time.monotonic() + 15
    while marked_pids(env["DDL_TEST_MARKER"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = marked_pids(env["DDL_TEST_MARKER"])
    assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in left]


def test_two_ranks_that_saw_each_other_lost_do_not_form_the_same_world_again(tmp_path):
    """A link between two ranks broke: each reports the other lost. The one reported first
    (not yet joined then) is stopped after the grace although it joined meanwhile, and
    the next world forms without it; before, both had joined, nobody was stopped, and the
    same world formed and failed again, forever. The driver runs on real processes
    (``sleep``, started through ``starter=``) and is fed the workers' messages."""
    import io
    from ddl.launcher.elastic.discovery import Blacklist, Discovery
    from ddl.launcher.elastic.driver import ElasticJob, WorkerProcess
    from ddl.launcher.elastic.worlds import LOST_GRACE_S

    def starter(index, host, slot, env):
        return WorkerProcess(subprocess.Popen(["sleep", "60"], start_new_session=True))

    err = io.StringIO()
    job = ElasticJob(["true"], min_np=2, max_np=3, np=3,
                     discovery=Discovery("", 3, [("localhost", 3)]), blacklist=Blacklist(),
                     elastic_timeout=30, reset_limit=None, start_timeout=30, starter=starter,
                     stderr=err)

    def pump(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                job._handle(job._events.get(timeout=0.05))
            except queue.Empty:
                pass
            assert job._check() is None, err.getvalue()

    try:
        job.start()
        workers = [job._workers[i] for i in sorted(job._workers)]
        assert len(workers) == 3
        for w in workers:
            job._on_message(w, {"op": "join"})
        pump(0.2)
        assert job.generation == 0 and job.members == [0, 1, 2], err.getvalue()
        t0 = time.monotonic()
        job._on_message(workers[1], {"op": "join", "reason": "PeerLostError", "lost": [2]})
        job._on_message(workers[2], {"op": "join", "reason": "PeerLostError", "lost": [1]})
        job._on_message(workers[0], {"op": "join", "reason": "PeerLostError", "lost": []})
        while job.generation == 0 and time.monotonic() - t0 < 10:
            pump(0.1)
        assert job.generation == 1 and job.members == [0, 1], err.getvalue()
        assert time.monotonic() - t0 >= LOST_GRACE_S and workers[2].state == "gone"
        assert re.search(r"worker 2 \(host localhost, pid \d+\) \(rank 2 of world 0\) was lost "
                         r"\(worker 1 saw rank 2 lost\); stopping it", err.getvalue())
    finally:
        job.close()
