"""Failures during start-up, and the one line ddlrun prints (issue 15).

* A rank killed or frozen in each phase of ``ddl.init()`` (and in the first data-plane
  connections after it) makes every other rank raise an error naming it and the phase,
  and ddlrun's last line names it.
* ddlrun's last line names the process that failed first (a coordinator by host and
  pid, or a rank), and no message repeats itself.
* ``ddl.init()`` after ``ddl.shutdown()``.

Real ``ddlrun`` jobs of :mod:`_fault_scripts` (see tests/test_failures.py), with short
liveness settings; the autouse leak check of ``conftest.py`` fails a test that leaves
anything behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_failures import World, coordinator_pids, marked_pids
from test_launcher_support import assert_no_survivors, job_env

from ddl.dataplane.transports.shm import available as shm_available

LIVENESS_S = 2.0
START_TIMEOUT_S = 4.0
SHORT = {"DDL_HEARTBEAT_INTERVAL_SECONDS": "0.5",
         "DDL_LIVENESS_TIMEOUT_SECONDS": str(LIVENESS_S),
         "DDL_START_TIMEOUT": str(START_TIMEOUT_S)}
# Generous bounds (3x the promise) on how soon the survivors raise after the fault.
KILL_RAISE_WITHIN_S = 6.0
FREEZE_RAISE_WITHIN_S = 3 * (LIVENESS_S + 1.0)


@pytest.fixture
def world(tmp_path):
    made = []

    def make(*args, **kwargs) -> World:
        w = World(tmp_path, *args, **dict(SHORT, **kwargs))
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def no_repeats(text: str, one_message: bool = True) -> None:
    """No phrase of a failure message said twice: a class name, "was lost", a culprit."""
    for line in text.splitlines():
        assert not re.search(r"\b(\w+Error): (?:.*\b)?\1: ", line), line
    if not one_message:
        return
    assert text.count("was lost") <= 1, text
    assert not re.search(r"(rank \d+) \([^)]*\) \w[^;]*\1 \(", text), text


# -- a rank lost in each phase of start-up --------------------------------------------------

# phase -> (fault point, hits to let pass, extra environment, what every survivor's
# message must say of the phase; None: the culprit is lost after init() returned)
SHM = pytest.mark.skipif(not shm_available(), reason="no shared memory here")
PHASES = {
    "rendezvous": ("init.register", 0, {}, "while registering with the coordinator"),
    "control stream": ("init.registered", 0, {}, "before it opened its control stream"),
    "cache shm attach": ("shm.attach", 0, {}, "attaching the response cache's shared memory"),
    "first shm attach": ("shm.attach", 1, {}, None),
    "first tcp connect": ("tcp.dial", 0, {"transport": "tcp"}, None),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("action", ["sigkill", "sigstop"])
@pytest.mark.parametrize("phase", [pytest.param(p, marks=SHM) if "shm" in p else p
                                   for p in PHASES])
def test_a_rank_lost_while_the_job_starts(world, phase, action):
    """Rank 1 of 3 is killed or frozen at a point of start-up: ranks 0 and 2 raise an
    error naming rank 1 and (during init) the phase they were in, and ddlrun's last line
    names rank 1."""
    point, after, extra, said = PHASES[phase]
    victim, survivors = 1, [0, 2]
    w = world(3, "loop", {"nbytes": 1 << 16}, **extra,
              fault=f"rank={victim};point={point};after={after};action={action};"
                    f"note={{note}}")
    _, _, _, t_fault, _ = w.note(within=30)
    within = KILL_RAISE_WITHIN_S if action == "sigkill" else FREEZE_RAISE_WITHIN_S
    errs = w.errors(survivors, within=within + 5)
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        message = e["message"]
        assert e["fields"]["rank"] == victim, context
        assert e["t"] - t_fault < within, context
        assert e["type"] == "PeerLostError", context
        assert re.search(rf"\brank {victim} (\(host [^)]*\) )?was lost", message), context
        if said is not None:
            assert e["call"] == {"init": True}, context
            assert message.startswith(f"ddl.init() failed on rank {rank} while "), context
            assert said in message, context
        no_repeats(message)
    assert w.wait(30) != 0
    how = (r"was killed by signal 9 \(SIGKILL\)" if action == "sigkill"
           else r"was lost: (its process is stopped|it sent nothing|it did not register|"
              r"it did not open)[^;]*")
    assert re.fullmatch(rf"ddlrun: rank {victim} \(pid \d+\) {how}; the job was stopped",
                        w.summary()), w.describe()
    no_repeats(w.summary())
    assert_no_survivors(w.marker)


def _workers(marker: str):
    """The pids of a job's worker processes (started once its coordinator is ready)."""
    found = []
    for pid in marked_pids(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"_fault_scripts" in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.timeout(60)
def test_a_coordinator_frozen_while_the_ranks_register(world, tmp_path):
    """The coordinator is stopped before the ranks connect (its socket takes their
    connections into the listen queue, and nothing answers): every rank's init() raises
    CoordinatorLostError naming its process within seconds (not DDL_START_TIMEOUT), and
    ddlrun's last line names the coordinator."""
    gate = tmp_path / "go"
    w = world(3, "loop", {"nbytes": 1 << 10, "init_after": str(gate)}, DDL_START_TIMEOUT="30")
    deadline = time.monotonic() + 20
    while coordinator_pids(w.marker)["leader"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = coordinator_pids(w.marker)["leader"]
    assert pid is not None, w.describe()
    while len(_workers(w.marker)) < 3 and time.monotonic() < deadline:  # its socket is up
        time.sleep(0.01)
    os.kill(pid, signal.SIGSTOP)
    t_fault = time.monotonic()
    gate.write_text("")
    errs = w.errors(range(3), within=FREEZE_RAISE_WITHIN_S + 5)
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "CoordinatorLostError", context
        assert e["fields"]["pid"] == pid, context
        assert e["t"] - t_fault < FREEZE_RAISE_WITHIN_S, context
        assert e["message"].startswith(f"ddl.init() failed on rank {rank} while registering"), \
            context
        assert "its process is stopped (SIGSTOP or a debugger)" in e["message"], context
        no_repeats(e["message"])
    assert w.wait(30) != 0
    host = os.uname().nodename
    assert re.fullmatch(rf"ddlrun: the coordinator \(host {re.escape(host)}, pid {pid}\) was "
                        rf"lost: its process is stopped \(SIGSTOP or a debugger\): frozen for "
                        rf"\d\.\d s; the job was stopped", w.summary()), w.describe()
    assert_no_survivors(w.marker)


# -- the summary names the first cause, once -------------------------------------------------

def _signal_coordinator(w: World, signum: int) -> int:
    w.wait_ready()
    time.sleep(0.3)  # allreduces running
    pid = coordinator_pids(w.marker)["leader"]
    os.kill(pid, signum)
    return pid


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["coordinator sigkill", "coordinator sigstop",
                                  "coordinator sigterm", "stall", "lost rank"])
def test_the_summary_names_the_first_cause_once(world, case):
    host = os.uname().nodename
    if case == "stall":
        w = world(3, "stall", {"rank": 2, "sleep": 4}, DDL_STALL_CHECK_TIME_SECONDS="0.5",
                  DDL_STALL_SHUTDOWN_TIME_SECONDS="1.5")
        w.wait_ready()
        expected = (rf"ddlrun: rank 2 \(pid {w.pid(2)}\) exited with code 1 after raising "
                    rf"StallError: allreduce 'never' in process set 0 has waited \d+\.\d s: "
                    rf"submitted by ranks \[0, 1\], missing ranks \[2\]; the job was stopped")
        kinds = {"StallError"}
    elif case == "lost rank":
        w = world(3, "loop", {"nbytes": 1 << 16})
        w.wait_ready()
        time.sleep(0.3)
        os.kill(w.pid(2), signal.SIGSTOP)
        # keepalive names it first; on a loaded machine the 2 s liveness check may win
        expected = (rf"ddlrun: rank 2 \(pid {w.pid(2)}\) was lost: (its process is stopped "
                    rf"\(SIGSTOP or a debugger\): frozen or unreachable: no keepalive answer "
                    rf"within 1\.5 s|it sent nothing for \d+\.\d s \(liveness timeout 2 s\): "
                    rf"frozen, hung or unreachable); the job was stopped")
        kinds = {"PeerLostError"}
    else:
        w = world(2, "loop", {"nbytes": 1 << 16})
        signum = {"coordinator sigkill": signal.SIGKILL, "coordinator sigstop": signal.SIGSTOP,
                  "coordinator sigterm": signal.SIGTERM}[case]
        pid = _signal_coordinator(w, signum)
        who = rf"ddlrun: the coordinator \(host {re.escape(host)}, pid {pid}\)"
        expected = who + {
            signal.SIGKILL: r" was killed by signal 9 \(SIGKILL\)",
            signal.SIGSTOP: r" was lost: its process is stopped \(SIGSTOP or a debugger\): "
                            r"(it sent nothing for \d+\.\d s \(liveness timeout 2 s\): "
                            r"frozen, hung or unreachable|frozen or unreachable: no "
                            r"keepalive answer within 1\.5 s)",
            signal.SIGTERM: r" exited with code 1: it received SIGTERM"}[signum]
        expected += "; the job was stopped"
        kinds = {signal.SIGKILL: {"CoordinatorLostError"},
                 signal.SIGSTOP: {"CoordinatorLostError"},
                 signal.SIGTERM: {"ShutdownError"}}[signum]
    ranks = range(w.np)
    errs = w.errors([r for r in ranks if case != "lost rank" or r != 2], within=20)
    for rank, e in errs.items():
        assert e["type"] in kinds, f"rank {rank} raised {e}; {w.describe()}"
        no_repeats(e["message"])
    w.wait(30)
    assert re.fullmatch(expected, w.summary()), w.describe()
    no_repeats(w.summary())
    no_repeats(w.stderr(), one_message=False)  # tracebacks too: "StallError: StallError: ..." is gone
    assert_no_survivors(w.marker)


# -- ddl.init() after ddl.shutdown() ---------------------------------------------------------

REINIT = """
    import sys, time
    import numpy as np
    import ddl
    ddl.init()
    assert float(ddl.allreduce(np.ones(4, np.float32), name="a", op=ddl.Sum)[0]) == ddl.size()
    rank = ddl.rank()
    ddl.shutdown()
    t0 = time.monotonic()
    try:
        ddl.init()
    except ddl.BootstrapError as exc:
        print(f"rank {rank} raised after {time.monotonic() - t0:.2f} s: {exc}")
        sys.exit(3)
    print(f"rank {rank}: init() after shutdown() returned")
"""


@pytest.mark.timeout(60)
def test_init_after_shutdown_under_ddlrun_fails_at_once_on_every_rank(tmp_path):
    """A second ddl.init() after ddl.shutdown() cannot rejoin the job (its coordinator
    ends once every rank left): every rank raises BootstrapError at once, saying so and
    what to do instead (it used to wait DDL_START_TIMEOUT, then blame the coordinator)."""
    from test_launcher_support import ddlrun, script
    path = script(tmp_path, "reinit.py", REINIT)
    r = ddlrun(["-np", "2", sys.executable, path], job_env(tmp_path), timeout=50)
    assert r.returncode == 3, r.stdout + r.stderr
    for rank in range(2):
        m = re.search(rf"\[{rank}\]<stdout>:rank {rank} raised after (\d+\.\d+) s: (.*)",
                      r.stdout)
        assert m, r.stdout + r.stderr
        assert float(m.group(1)) < 2.0, m.group(0)  # at once: no rendezvous, no timeout
        assert m.group(2).startswith(
            f"ddl.init() after ddl.shutdown() is not supported in a job started by ddlrun or "
            f"ddl.run: rank {rank} already left job "), m.group(2)
        assert "start each with its own ddlrun" in m.group(2), m.group(2)


def test_init_after_shutdown_in_one_process_starts_a_new_job(tmp_path):
    """Without a launcher, each init() starts a job of its own: init, shutdown, init
    again works, twice."""
    body = REINIT.replace("print(f\"rank {rank}: init()", "print(f\"again {ddl.size()}\")\n"
                          "    ddl.allreduce(np.ones(2), name='b')\n    ddl.shutdown()\n"
                          "    ddl.init()\n    ddl.shutdown()\n    print(f\"rank {rank}: init()")
    from test_launcher_support import script
    path = script(tmp_path, "reinit1.py", body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    r = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "again 1" in r.stdout and "init() after shutdown() returned" in r.stdout, r.stdout
