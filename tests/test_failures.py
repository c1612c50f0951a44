"""Failures (issue 3): nothing hangs, every rank learns who failed and why, nothing is left.

Real ``ddlrun`` jobs run the worker program :mod:`_fault_scripts`, which records what
each rank raised (type, message, moment) in files; faults come from the script itself
(a rank that leaves) or from ``DDL_TEST_FAULT`` (:mod:`ddl.core.faults`: a signal at an
exact step of a collective). Within a host the data path is shared memory by default;
``DDL_TRANSPORT=tcp`` gives the path ranks on different hosts use, and the cases where
the two differ run on both. Every test has a hard outer timeout, and the autouse leak
check of ``conftest.py`` fails a test that leaves a process or a file behind.

Covered elsewhere, not repeated here: a rank that ``os._exit(0)``s between collectives
(test_errors.py); dead, stopped and closing peers of one shared-memory group, in process
(test_shm_failures.py); a rank lost on a relayed node, and a non-leader coordinator
killed in a two-node job (test_server_peers.py); ``kill -9`` of ddlrun with plain
workers, signals to ddlrun and exit codes (test_launcher_failures.py); stall warnings and
aborts of the coordinator itself (test_server_grpc.py, test_server_leader.py); silent
workers and coordinators, in process (test_liveness.py); ranks submitting different names
in different orders *asynchronously* (_checks.check_collectives).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from test_launcher_support import assert_no_survivors, job_env, marked_pids

from ddl.core import config as _config
from ddl.core import faults as _faults
from ddl.dataplane.transports.shm import available as shm_available

# The figures every failure must meet.
RAISE_WITHIN_S = 2.0  # survivors raise the error naming the cause
DDLRUN_EXIT_WITHIN_S = 8.0  # ddlrun is done after a rank failed
OWN_EXIT_WITHIN_S = 5.0  # a rank that leaves on its own is gone
COORDINATOR_DDLRUN_EXIT_WITHIN_S = 10.0
ORPHANS_EXIT_WITHIN_S = 10.0  # after ddlrun itself was killed
BIG = 64 << 20  # bytes of the allreduce a rank is killed in
MID = 16 << 20


def _has_var(name: str) -> bool:
    return any(v.name == name for v in _config.VARIABLES)


HEARTBEATS = (_has_var("DDL_HEARTBEAT_INTERVAL_SECONDS")
              and _has_var("DDL_LIVENESS_TIMEOUT_SECONDS"))


# -- a job under test ---------------------------------------------------------------------

class World:
    """``ddlrun -np N python -m _fault_scripts OUT SCENARIO OPTS`` in the background."""

    def __init__(self, tmp_path, np_: int, scenario: str, opts=None, *, fault: str = "",
                 nodes: str = "", transport: str = "", **env):
        n = len(list(tmp_path.glob("world*")))
        self.dir = tmp_path / f"world{n}"
        self.out = self.dir / "out"
        self.out.mkdir(parents=True)
        self.np = np_
        extra = dict(env)
        if fault:  # "{note}": the fault's note file, read by World.note()
            extra["DDL_TEST_FAULT"] = fault.replace("{note}", str(self.dir / "note"))
        if nodes:
            extra["DDL_TEST_LOCAL_NODES"] = nodes
        if transport:  # the data path within a host: shm (the default) or tcp
            extra["DDL_TRANSPORT"] = transport
        self.env = job_env(self.dir, **extra)
        self.marker = self.env["DDL_TEST_MARKER"]
        self._stdout = open(self.dir / "stdout", "w")
        self._stderr = open(self.dir / "stderr", "w")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddl.launcher.cli", "-np", str(np_), sys.executable, "-m",
             "_fault_scripts", str(self.out), scenario, json.dumps(opts or {})],
            env=self.env, stdin=subprocess.DEVNULL, stdout=self._stdout, stderr=self._stderr)
        self.t_end = None

    # files the ranks write
    def _path(self, name: str):
        return self.out / name

    def read(self, name: str):
        try:
            return json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return None

    def wait_for(self, names, within: float):
        deadline = time.monotonic() + within
        while True:
            got = {n: self.read(n) for n in names}
            if all(v is not None for v in got.values()):
                return got
            if time.monotonic() > deadline:
                missing = [n for n, v in got.items() if v is None]
                raise AssertionError(f"timed out after {within:g} s waiting for {missing}; "
                                     f"{self.describe()}")
            time.sleep(0.01)

    def wait_ready(self, within: float = 30.0):
        return self.wait_for([f"{r}.pid" for r in range(self.np)], within)

    def errors(self, ranks, within: float):
        got = self.wait_for([f"{r}.err" for r in ranks], within)
        return {r: got[f"{r}.err"] for r in ranks}

    def pid(self, rank: int) -> int:
        return self.read(f"{rank}.pid")["pid"]

    def host(self, rank: int) -> str:
        return self.read(f"{rank}.pid")["host"]

    def note(self, within: float, context: str = ""):
        """The fault hook's note: (rank, point, hit, t, action) of the first fault."""
        path = self.dir / "note"
        deadline = time.monotonic() + within
        while not (path.exists() and path.read_text().endswith("\n")):
            assert time.monotonic() < deadline, (f"{context}the fault never acted; "
                                                 f"{self.describe()}")
            time.sleep(0.01)
        rank, point, hit, t, action = path.read_text().splitlines()[0].split()
        return int(rank), point, int(hit), float(t), action

    # ddlrun
    def wait(self, within: float) -> int:
        try:
            rc = self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ddlrun did not exit within {within:g} s; "
                                 f"{self.describe()}") from None
        self.t_end = self.t_end or time.monotonic()
        return rc

    def stderr(self) -> str:
        self._stderr.flush()
        return (self.dir / "stderr").read_text()

    def summary(self) -> str:
        """ddlrun's own last line (``ddlrun: ...``)."""
        lines = [l for l in self.stderr().splitlines() if l.startswith("ddlrun: ")]
        assert lines, self.describe()
        return lines[-1]

    def describe(self) -> str:
        files = {p.name: p.read_text()[:300] for p in sorted(self.out.iterdir())
                 if not p.name.endswith(".tmp")}
        return f"rank files: {files}\nddlrun stderr:\n{self.stderr()[-3000:]}"

    def close(self):
        if self.proc.poll() is None:  # a failed test: let ddlrun clean up if it can
            self.proc.terminate()
            try:
                self.proc.wait(12)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._stdout.close()
        self._stderr.close()


@pytest.fixture
def world(tmp_path):
    made = []

    def make(*args, **kwargs) -> World:
        w = World(tmp_path, *args, **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def wait_dead(pid: int, within: float) -> float:
    """The moment ``pid`` is gone or a zombie (polled every 10 ms)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        now = time.monotonic()
        if state in ("gone", "Z", "X"):
            return now
        assert now < deadline, f"pid {pid} still alive (state {state}) after {within:g} s"
        time.sleep(0.01)


def coordinator_pids(marker: str):
    """{"leader": pid, "relay": [pids]} of a job's coordinator daemons."""
    out = {"leader": None, "relay": []}
    for pid in marked_pids(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"ddl.server.daemon" not in argv:
            continue
        if b"--leader" in argv:
            out["relay"].append(pid)
        else:
            out["leader"] = pid
    return out


def assert_peer_lost(w: World, errs, culprit: int, t_fault: float, seed_note: str = ""):
    """Every survivor raised PeerLostError naming ``culprit`` by rank, host and pid,
    within RAISE_WITHIN_S of ``t_fault``."""
    who = f"rank {culprit} (host {w.host(culprit)}, pid {w.pid(culprit)})"
    for rank, e in errs.items():
        context = f"{seed_note}rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "PeerLostError", context
        assert who in e["message"], context
        assert e["fields"]["rank"] == culprit and e["fields"]["pid"] == w.pid(culprit), context
        assert e["t"] - t_fault < RAISE_WITHIN_S, context


def assert_summary_names(w: World, rank: int):
    assert re.match(rf"ddlrun: rank {rank} \(pid {w.pid(rank)}\) ", w.summary()), w.describe()


# -- the fault hooks themselves ------------------------------------------------------------

@pytest.mark.parametrize("spec, field", [
    ("point=ring.step;action=sigkill", "'rank' is missing"),
    ("rank=x;point=ring.step;action=sigkill", "field 'rank' has a bad value 'x'"),
    ("rank=1;point=ring.stp;action=sigkill", "field 'point' has a bad value 'ring.stp'"),
    ("rank=1;point=ring.step", "field 'action' is missing"),
    ("rank=1;point=ring.step;action=explode", "field 'action' has a bad value 'explode'"),
    ("rank=1;point=ring.step;action=exit:256", "field 'action' has a bad value 'exit:256'"),
    ("rank=1;point=ring.step;action=sleep:-1", "field 'action' has a bad value 'sleep:-1'"),
    ("rank=1;point=ring.step;action=sigkill:2", "field 'action' has a bad value"),
    ("rank=1;point=ring.step;action=sigkill;after=-1", "field 'after' has a bad value '-1'"),
    ("rank=1;point=ring.step;action=sigkill;after=2.5", "field 'after' has a bad value"),
    ("rank=1;point=ring.step;action=sigkill;p=1.5", "field 'p' has a bad value '1.5'"),
    ("rank=1;point=ring.step;action=sigkill;seed=s", "field 'seed' has a bad value 's'"),
    ("rank=1;point=ring.step;action=sigkill;when=3", "unknown field 'when'"),
    ("rank=1;point=ring.step;action=sigkill;rank=2", "field 'rank' is given twice"),
    ("rank=1;point=ring.step;sigkill", "'sigkill' in"),
    ("rank=1;point=ring.step;action=sigkill|", "empty fault spec"),
])
def test_fault_spec_errors_name_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        _faults.parse(spec)
    assert str(info.value).startswith("DDL_TEST_FAULT: "), info.value


def test_fault_hooks_act_at_the_exact_hit():
    assert _faults.ACTIVE is None  # inert unless DDL_TEST_FAULT is set
    try:
        _faults.arm("rank=3;point=ring.step;after=2;action=raise|"
                    "rank=*;point=rd.step;action=sleep:0", rank=3)
        _faults.hit("ring.step")
        _faults.hit("ring.step")
        with pytest.raises(_faults.FaultInjected, match=r"rank 3 at ring.step \(hit 2\)"):
            _faults.hit("ring.step")
        _faults.hit("ring.step")  # a fault acts once
        _faults.hit("rd.step")
        _faults.arm("rank=1;point=ring.step;action=raise", rank=0)
        assert _faults.ACTIVE is None  # not this rank's fault
        # p and seed: a reproducible random hit at or after `after`
        moments = []
        for _ in range(2):
            _faults.arm("rank=0;point=tcp.chunk;after=5;p=0.1;seed=7;action=raise", rank=0)
            for k in range(10_000):
                try:
                    _faults.hit("tcp.chunk")
                except _faults.FaultInjected:
                    moments.append(k)
                    break
        assert moments[0] == moments[1] >= 5, moments
    finally:
        _faults.arm(None)


# -- a rank dies or leaves -----------------------------------------------------------------

# The data paths within a host, and a fault point in the middle of a 64 MiB allreduce of 4
# ranks on each: TCP has 6 ring steps per allreduce, hit 3 is the first step of the
# allgather half; shared memory has one step per 1 MiB chunk.
MID_ALLREDUCE = {"tcp": ("ring.step", 3), "shm": ("shm.step", 20)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [
    "tcp", pytest.param("shm", marks=pytest.mark.skipif(not shm_available(),
                                                        reason="no shared memory here"))])
def test_sigkill_during_a_64mib_allreduce(world, transport):
    point, after = MID_ALLREDUCE[transport]
    w = world(4, "loop", {"nbytes": BIG}, transport=transport,
              fault=f"rank=2;point={point};after={after};action=sigkill;note={{note}}")
    _check_kill(w, 2)


def _check_kill(w: World, victim: int, seed_note: str = ""):
    w.wait_ready()
    rank, point, _, t_fault, action = w.note(within=30, context=seed_note)
    assert (rank, action) == (victim, "sigkill")
    survivors = [r for r in range(w.np) if r != victim]
    errs = w.errors(survivors, within=RAISE_WITHIN_S + 3)
    assert_peer_lost(w, errs, victim, t_fault, seed_note)
    rc = w.wait(DDLRUN_EXIT_WITHIN_S + 2)
    assert w.t_end - t_fault < DDLRUN_EXIT_WITHIN_S, (seed_note, w.t_end - t_fault)
    assert rc == 128 + signal.SIGKILL, w.describe()
    assert_summary_names(w, victim)
    assert "was killed by signal 9 (SIGKILL)" in w.summary()
    assert_no_survivors(w.marker)


STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lazy", ["0", "1"], ids=["eager", "lazy-streams"])
def test_sigkill_during_a_device_allreduce(world, lazy):
    """Rank 1 of 3 killed inside a 16 MiB allreduce of CuPy arrays over CUDA IPC (on the
    CuPy stand-in of tests/standin, with 1 MiB device slots: the kill comes in a round of
    the device collective; tests/gpu kills one on a GPU): the others raise PeerLostError
    naming it, ddlrun exits, and the survivors free their device segments."""
    path = os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p)
    w = world(3, "loop", {"nbytes": MID, "cupy": True}, PYTHONPATH=path,
              DDL_CUDA_IPC_SLOT_MB="1", DDL_TEST_LAZY_STREAMS=lazy,
              fault="rank=1;point=device.round;after=12;action=sigkill;note={note}")
    try:
        _check_kill(w, 1)
    finally:   # the killed rank's segments (a GPU's driver frees those of a dead process)
        victim = w.read("1.pid")
        for name in os.listdir("/dev/shm"):
            if victim and name.startswith(f"ddl-standin-cuda-"
                                          f"{os.environ['DDLTEST_SESSION']}-{victim['pid']}-"):
                os.unlink(os.path.join("/dev/shm", name))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lazy", ["0", "1"], ids=["eager", "lazy-streams"])
def test_sigkill_during_a_device_allreduce_over_nccl(world, lazy):
    """Rank 1 of 3, each on a GPU of its own without peer access (so one NCCL
    communicator; the NCCL stand-in of tests/standin), killed as it hands its 6th
    collective to NCCL, while the others wait inside theirs: they raise PeerLostError
    naming it (their communicators aborted) and ddlrun exits."""
    path = os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p)
    w = world(3, "loop", {"nbytes": MID, "cupy": True}, PYTHONPATH=path, DDL_TEST_GPUS="3",
              DDL_TEST_LAZY_STREAMS=lazy,
              fault="rank=1;point=nccl.call;after=5;action=sigkill;note={note}")
    try:
        _check_kill(w, 1)
    finally:   # what the killed rank's NCCL stand-in left (its own files)
        for name in os.listdir("/dev/shm"):
            if name.startswith("ddl-standin-nccl-" + os.environ["DDLTEST_SESSION"]):
                os.unlink(os.path.join("/dev/shm", name))


_SLOTS = """
import os, sys
import cupy, ddl
os.environ["DDL_CUDA_IPC_SLOT_MB"] = "1" if os.environ["DDL_RANK"] == "0" else "2"
ddl.init()
try:
    ddl.allreduce(cupy.ones(4, cupy.float32), name="slots")
except (ddl.MismatchError, ddl.PeerLostError) as exc:
    print(f"SLOTS {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
print("SLOTS none", flush=True)
"""


@pytest.mark.timeout(60)
def test_ranks_whose_device_slots_differ_fail_before_touching_each_other(tmp_path):
    """DDL_CUDA_IPC_SLOT_MB 1 on rank 0 and 2 on rank 1 (CuPy stand-in): the first device
    collective fails on both ranks with an error naming both sizes, before either reads
    or writes the other's slots; no device segment is left (tests/gpu does it on a GPU)."""
    from test_launcher_support import ddlrun, script
    path = os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p)
    r = ddlrun(["-np", "2", sys.executable, script(tmp_path, "slots.py", _SLOTS)],
               job_env(tmp_path, PYTHONPATH=path), timeout=50)
    said = re.findall(r"SLOTS (.*)", r.stdout)
    assert r.returncode != 0 and len(said) == 2, r.stdout + r.stderr[-3000:]
    assert any(s.startswith("MismatchError") for s in said), said
    assert all(str(1 << 20) in s and str(2 << 20) in s for s in said), said


_LATE_READ = """
import sys, time
import numpy as np
import cupy, ddl
ddl.init()
rank = ddl.rank()
result = ddl.allreduce(cupy.full(1000, rank + 1.0, cupy.float32), name="last", op=ddl.Sum)
if rank == 1:   # its stream has not read rank 0's slot yet (lazy streams)
    time.sleep(1.0)
got = result.get()
start = time.monotonic()
ddl.shutdown()
print(f"LATE rank {rank} got {got[:3].tolist()} shutdown {time.monotonic() - start:.2f} s",
      flush=True)
sys.exit(0 if np.all(got == 3.0) else 1)
"""


@pytest.mark.timeout(60)
def test_a_rank_shutting_down_keeps_its_device_slot_until_the_peers_have_read_it(tmp_path):
    """Rank 0 shuts down right after an allreduce over CUDA IPC, while rank 1's stream
    has yet to read rank 0's slot (lazy streams of the CuPy stand-in, whose free() poisons
    the memory): rank 0 frees its segment only after rank 1 has entered the close round,
    so rank 1 reads the right values; both leave no segment."""
    from test_launcher_support import ddlrun, script
    path = os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p)
    r = ddlrun(["-np", "2", sys.executable, script(tmp_path, "late.py", _LATE_READ)],
               job_env(tmp_path, PYTHONPATH=path, DDL_TEST_LAZY_STREAMS="1"), timeout=50)
    said = sorted(re.findall(r"LATE (.*)", r.stdout))
    assert r.returncode == 0 and len(said) == 2, r.stdout + r.stderr[-3000:]
    assert all("got [3.0, 3.0, 3.0]" in s for s in said), said


# How a rank that leaves on its own ends, as ddlrun's summary says it.
LEAVES = {
    "exit0": "exited with code 0",
    "exit1": "exited with code 1",
    "abort": "was killed by signal 6 (SIGABRT)",
    "sigterm": "was killed by signal 15 (SIGTERM)",
    "raise": "exited with code 1",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, action", [
    # the default data path within a host (shared memory), every way of leaving
    pytest.param("", "exit0", id="default-exit0"),
    pytest.param("", "exit1", id="default-exit1"),
    pytest.param("", "abort", id="default-abort"),
    pytest.param("", "sigterm", id="default-sigterm"),
    pytest.param("", "raise", id="default-raise"),
    # TCP, for the ways that end in a goodbye (the others are like a kill: see above)
    pytest.param("tcp", "exit0", id="tcp-exit0"),
    pytest.param("tcp", "exit1", id="tcp-exit1"),
    pytest.param("tcp", "raise", id="tcp-raise")])
def test_a_rank_that_leaves_mid_collective(world, transport, action):
    """Rank 2 of 4 leaves with a 16 MiB allreduce in flight: ``sys.exit(0)``,
    ``sys.exit(1)``, ``os.abort()``, SIGTERM to itself, or an uncaught exception."""
    victim = 2
    w = world(4, "loop", {"nbytes": MID, "rank": victim, "at": 2, "action": action,
                          "delay": 0.1}, transport=transport)
    w.wait_ready()
    t_act = w.wait_for([f"{victim}.acted"], within=30)[f"{victim}.acted"]["t"]
    t_dead = wait_dead(w.pid(victim), OWN_EXIT_WITHIN_S + 5)
    assert t_dead - t_act < OWN_EXIT_WITHIN_S, (t_dead - t_act, w.describe())
    survivors = [r for r in range(w.np) if r != victim]
    errs = w.errors(survivors, within=RAISE_WITHIN_S + 3)
    assert_peer_lost(w, errs, victim, t_act)
    rc = w.wait(DDLRUN_EXIT_WITHIN_S + 2)
    assert w.t_end - t_act < DDLRUN_EXIT_WITHIN_S, w.t_end - t_act
    assert rc != 0, w.describe()
    assert_summary_names(w, victim)
    assert LEAVES[action] in w.summary(), w.describe()
    if action in ("exit0", "exit1"):  # and why, as the rank said on its way out
        assert "(the process exited" in w.summary() and "without calling ddl.shutdown()" \
            in w.summary(), w.describe()
    assert_no_survivors(w.marker)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim, point", [
    pytest.param(0, "tcp.dial", id="dialing-rank"),
    pytest.param(1, "tcp.accept", id="accepting-rank")])
def test_sigkill_while_the_first_connection_is_made(world, victim, point):
    """A rank dies in the first collective as its data-plane connection to its peer is
    being made (connections open on first use; the lower rank dials, the higher one
    accepts), before the handshake: the peer must still raise PeerLostError naming it."""
    w = world(2, "loop", {"nbytes": 1 << 20}, transport="tcp",
              fault=f"rank={victim};point={point};action=sigkill;note={{note}}")
    _check_kill(w, victim)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, point", [
    ("tcp", "ring.step"),
    pytest.param("shm", "shm.step", marks=pytest.mark.skipif(not shm_available(),
                                                             reason="no shared memory here"))])
def test_an_error_inside_a_collective_on_one_rank(world, transport, point):
    """Rank 1 of 3 fails inside a collective (an exception in its engine thread, as a bug
    or a MemoryError would raise): its own call raises, and every other rank raises
    PeerLostError naming it, within 2 s."""
    victim = 1
    w = world(3, "loop", {"nbytes": MID}, transport=transport,
              fault=f"rank={victim};point={point};after=5;action=raise;note={{note}}")
    w.wait_ready()
    _, _, _, t_fault, _ = w.note(within=30)
    errs = w.errors(range(3), within=RAISE_WITHIN_S + 3)
    assert "FaultInjected" in errs[victim]["message"], errs[victim]
    assert_peer_lost(w, {r: e for r, e in errs.items() if r != victim}, victim, t_fault)
    assert w.wait(DDLRUN_EXIT_WITHIN_S) != 0
    assert_summary_names(w, victim)
    assert_no_survivors(w.marker)


# Where a random kill may land, on each data path, and how many earlier hits to let pass
# at most.
RANDOM_POINTS = {
    "tcp": {"tcp.chunk": 60, "tcp.transfer": 30, "ring.step": 10, "rd.step": 6,
            "broadcast.step": 4},
    "shm": {"shm.step": 30},
}
if not shm_available():
    del RANDOM_POINTS["shm"]
RANDOM_TRIALS = 20


@pytest.mark.timeout(240)
def test_sigkill_at_seeded_random_moments(tmp_path, world):
    """20 jobs of 2 or 3 ranks running a random mix of collectives over shared memory or
    TCP; in each, one random rank is killed at a random hit of a random point. Reproduce
    with ``DDL_TEST_FAULT_SEED=<seed>`` (printed, and named in every failure)."""
    seed = int(os.environ.get("DDL_TEST_FAULT_SEED") or random.randrange(1 << 31))
    print(f"DDL_TEST_FAULT_SEED={seed}")
    rng = random.Random(seed)
    for trial in range(RANDOM_TRIALS):
        transport = rng.choice(sorted(RANDOM_POINTS))
        point = rng.choice(sorted(RANDOM_POINTS[transport]))
        # with 3 ranks, rank 0 sits the recursive-doubling steps out
        n = 2 if point == "rd.step" else rng.choice([2, 3])
        victim = rng.randrange(n)
        after = rng.randint(0, RANDOM_POINTS[transport][point])
        note = (f"DDL_TEST_FAULT_SEED={seed} trial {trial}: {n} ranks over {transport}, "
                f"rank {victim} killed at {point} hit {after}: ")
        w = world(n, "random", {"seed": rng.randrange(1 << 31)}, transport=transport,
                  fault=f"rank={victim};point={point};after={after};action=sigkill;"
                        f"note={{note}}")
        try:
            _check_kill(w, victim, note)
        finally:
            w.close()


# -- a coordinator dies --------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", ["", "2,2"], ids=["one-node", "two-node-leader"])
def test_sigkill_of_the_leader_coordinator(world, nodes):
    """The coordinator of node 0 (the leader) dies mid-job: its own workers lose their
    coordinator; on a two-node job the other node's workers learn it from their relay.
    (A non-leader coordinator killed: test_server_peers.test_relay_coordinator_killed.)"""
    n = 4 if nodes else 2
    w = world(n, "loop", {"nbytes": 1 << 20}, nodes=nodes)
    w.wait_ready()
    time.sleep(0.3)  # allreduces running
    coordinators = coordinator_pids(w.marker)
    assert coordinators["leader"] and len(coordinators["relay"]) == (1 if nodes else 0)
    t_kill = time.monotonic()
    os.kill(coordinators["leader"], signal.SIGKILL)
    errs = w.errors(range(n), within=RAISE_WITHIN_S + 3)
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "CoordinatorLostError", context
        assert e["t"] - t_kill < RAISE_WITHIN_S, context
        if rank >= 2:  # relayed: the leader is named
            assert "the leader coordinator" in e["message"], context
        else:  # its own: named by pid, and gone
            assert (f"lost the coordinator (pid {coordinators['leader']}) at " in e["message"]
                    and "its process has exited" in e["message"]), context
    rc = w.wait(COORDINATOR_DDLRUN_EXIT_WITHIN_S + 2)
    assert w.t_end - t_kill < COORDINATOR_DDLRUN_EXIT_WITHIN_S, w.t_end - t_kill
    assert rc != 0, w.describe()
    assert re.match(rf"ddlrun: the coordinator \(host [^,]+, pid {coordinators['leader']}\) "
                    rf"was killed by signal 9 \(SIGKILL\)", w.summary()), w.describe()
    assert_no_survivors(w.marker)


@pytest.mark.timeout(60)
def test_sigkill_of_ddlrun_takes_workers_and_coordinators_down(world):
    """ddlrun dies with SIGKILL in the middle of a two-node job: every worker (busy in
    allreduces) and both coordinators exit (the parent-death signal)."""
    w = world(4, "loop", {"nbytes": 1 << 20}, nodes="2,2")
    w.wait_ready()
    time.sleep(0.3)
    coordinators = coordinator_pids(w.marker)
    assert coordinators["leader"] and len(coordinators["relay"]) == 1
    pids = set(marked_pids(w.marker)) - {w.proc.pid}
    assert len(pids) >= 6, pids  # 4 workers, 2 coordinators
    with open(f"/proc/{coordinators['leader']}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    job_dir = argv[argv.index("--job-dir") + 1]
    assert os.path.isdir(job_dir), job_dir
    t_kill = time.monotonic()
    w.proc.kill()
    w.proc.wait(5)
    for pid in pids:
        assert wait_dead(pid, ORPHANS_EXIT_WITHIN_S) - t_kill < ORPHANS_EXIT_WITHIN_S, pid
    assert_no_survivors(w.marker, within=1)
    # the coordinators removed ddlrun's job directory (its sockets, its reports)
    assert job_dir and not os.path.exists(job_dir), os.listdir(job_dir)


# -- stalls and deadlocks ------------------------------------------------------------------

STALL_ENV = {"DDL_STALL_CHECK_TIME_SECONDS": "0.5", "DDL_STALL_SHUTDOWN_TIME_SECONDS": "2"}
STALL_SLACK_S = 2.5  # the leader checks for stalls about once a second


@pytest.mark.timeout(60)
def test_a_rank_that_never_submits_stalls_everyone(world):
    """Ranks 0-1 allreduce "never", rank 2 never does: a warning naming rank 2 and the
    tensor on every rank, then StallError on every rank at the shutdown time."""
    w = world(3, "stall", {"rank": 2, "sleep": 2 + STALL_SLACK_S}, **STALL_ENV)
    w.wait_ready()
    errs = w.errors(range(3), within=20)
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "StallError", context
        assert "allreduce 'never'" in e["message"], context
        assert "missing ranks [2]" in e["message"], context
    # the leader's clock starts at the first submission: that rank waited the whole 2 s,
    # the other one its own share of it
    waited = [w.read(f"{rank}.waited")["waited"] for rank in (0, 1)]
    assert 2.0 <= max(waited) and all(t < 2.0 + STALL_SLACK_S for t in waited), waited
    assert w.read("2.late")["waited"] < 0.5  # sticky: the next call raises at once
    rc = w.wait(DDLRUN_EXIT_WITHIN_S)
    assert rc != 0
    stderr = w.stderr()
    for rank in range(3):
        assert re.search(rf"\[{rank}\]<stderr>:.*stall: allreduce 'never' .*missing ranks "
                         rf"\[2\]", stderr), stderr
    assert "StallError" in w.summary() and "missing ranks [2]" in w.summary(), w.describe()
    assert_no_survivors(w.marker)


@pytest.mark.timeout(60)
def test_blocking_calls_in_opposite_orders_end_in_a_stall_error(world):
    """Rank 0 calls allreduce A then B, rank 1 B then A, each blocking: each waits for a
    name the other will only submit after its own call returns, a deadlock of the
    program. The leader cannot order what it has not seen, so the job must not hang:
    StallError on both ranks at the stall shutdown time."""
    w = world(2, "order", **STALL_ENV)
    w.wait_ready()
    t0 = max(w.read(f"{r}.pid")["t"] for r in range(2))
    errs = w.errors(range(2), within=20)
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "StallError", context
        assert re.search(r"allreduce '[AB]'", e["message"]), context
        assert e["t"] - t0 < 2.0 + STALL_SLACK_S, context
    assert w.read("0.ok") is None and w.read("1.ok") is None
    assert w.wait(DDLRUN_EXIT_WITHIN_S) != 0
    stderr = w.stderr()
    for rank in range(2):  # each rank was warned about both names, and what the other
        for name, missing, other in (("A", 1, "B"), ("B", 0, "A")):   # waits on instead
            assert re.search(rf"\[{rank}\]<stderr>:.*stall: allreduce '{name}' .*missing "
                             rf"ranks \[{missing}\]; rank {missing} waits on allreduce "
                             rf"'{other}' in process set 0", stderr), stderr
    assert_no_survivors(w.marker)


# -- a frozen rank -------------------------------------------------------------------------

KEEPALIVE_S = 2.0  # the short settings: a ping every 0.5-1 s, 1 s to answer it
HEARTBEAT_ENV = {"DDL_KEEPALIVE_INTERVAL_SECONDS": "0.5",
                 "DDL_KEEPALIVE_TIMEOUT_SECONDS": "1",
                 "DDL_HEARTBEAT_INTERVAL_SECONDS": "0.5",
                 "DDL_LIVENESS_TIMEOUT_SECONDS": "2"}
# The promise with the default settings (a ping every 0.5-1 s, 1.5 s to answer): survivors
# raise within 3 s of a freeze, ddlrun exits within 8 s. Asserted with 3x slack, so that
# a shared, loaded machine does not fail the test while a regression (to the 10 s
# liveness timeout and 17 s exits of Python heartbeats) does.
FROZEN_RAISE_WITHIN_S = 3.0
FROZEN_DDLRUN_EXIT_WITHIN_S = 8.0
SLACK = 3.0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HEARTBEATS, reason="needs DDL_HEARTBEAT_INTERVAL_SECONDS and "
                                           "DDL_LIVENESS_TIMEOUT_SECONDS (worker heartbeats)")
@pytest.mark.parametrize("transport, point", [
    ("tcp", "ring.step"),
    pytest.param("shm", "shm.step", marks=pytest.mark.skipif(not shm_available(),
                                                             reason="no shared memory here"))])
def test_a_frozen_rank_is_lost_and_learns_it_when_it_thaws(world, transport, point):
    """Rank 1 of 3 is stopped (SIGSTOP) mid-allreduce: its sockets and its shared memory
    stay as they are, only its unanswered keepalive pings give it away. The others raise
    PeerLostError naming it within the keepalive interval + timeout + 1 s. After SIGCONT
    its own pending call raises; it returns no data."""
    victim = 1
    w = world(3, "loop", {"nbytes": MID}, transport=transport,
              fault=f"rank={victim};point={point};after=5;action=sigstop;note={{note}}",
              **HEARTBEAT_ENV)
    w.wait_ready()
    _, _, _, t_freeze, _ = w.note(within=30)
    survivors = [0, 2]
    errs = w.errors(survivors, within=KEEPALIVE_S + 5)
    who = f"rank {victim} (host {w.host(victim)}, pid {w.pid(victim)})"
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "PeerLostError" and who in e["message"], context
        assert "no keepalive answer within 1 s" in e["message"], context
        assert e["t"] - t_freeze < KEEPALIVE_S + 1.0, context
    t_cont = time.monotonic()
    os.kill(w.pid(victim), signal.SIGCONT)
    own = w.errors([victim], within=5)[victim]
    assert own["type"] in ("PeerLostError", "CoordinatorLostError", "ShutdownError"), own
    assert own["t"] - t_cont < 3.0, own
    # the call that raised is the one that was pending when the rank froze: it returned
    # no data (had it returned, the next call would have raised instead)
    assert own["call"]["t"] < t_freeze, (own, t_freeze)
    rc = w.wait(DDLRUN_EXIT_WITHIN_S + 5)
    assert rc != 0
    assert_no_survivors(w.marker)
    assert own["type"] != "CoordinatorLostError" or "sent nothing" not in own["message"], own
    assert_summary_names(w, victim)


@pytest.mark.timeout(90)
def test_a_frozen_rank_with_the_default_settings(world):
    """Rank 1 of 3 is stopped mid-allreduce, with the default liveness settings: the
    others raise PeerLostError naming it as frozen within 3 s (asserted with 3x slack),
    and ddlrun, which kills a stopped process at once, exits within 8 s (3x slack)."""
    victim = 1
    w = world(3, "loop", {"nbytes": 1 << 20},
              fault=f"rank={victim};point=ring.step;after=5;action=sigstop;note={{note}}",
              transport="tcp")
    w.wait_ready()
    _, _, _, t_freeze, _ = w.note(within=30)
    errs = w.errors([0, 2], within=SLACK * FROZEN_RAISE_WITHIN_S)
    who = f"rank {victim} (host {w.host(victim)}, pid {w.pid(victim)})"
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["type"] == "PeerLostError" and who in e["message"], context
        assert ("its process is stopped (SIGSTOP or a debugger): frozen or unreachable: no "
                "keepalive answer within 1.5 s") in e["message"], context
        assert e["t"] - t_freeze < SLACK * FROZEN_RAISE_WITHIN_S, context
    rc = w.wait(SLACK * FROZEN_DDLRUN_EXIT_WITHIN_S)
    assert w.t_end - t_freeze < SLACK * FROZEN_DDLRUN_EXIT_WITHIN_S, w.t_end - t_freeze
    assert rc != 0
    assert_summary_names(w, victim)
    assert_no_survivors(w.marker)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nodes, frozen", [("", "leader"), ("2,2", "leader"),
                                           ("2,2", "relay")])
def test_a_frozen_coordinator_with_the_default_settings(world, nodes, frozen):
    """A coordinator is stopped (SIGSTOP) mid-job, default settings. Its own workers
    find its connection dead (no keepalive answer) and raise CoordinatorLostError; on a
    two-node job the other node's workers learn it from their own coordinator. Every
    worker raises within 3 s and ddlrun exits within 8 s (both with 3x slack)."""
    n = 4 if nodes else 2
    w = world(n, "loop", {"nbytes": 1 << 20}, nodes=nodes)
    w.wait_ready()
    time.sleep(0.3)  # allreduces running
    coordinators = coordinator_pids(w.marker)
    pid = coordinators["leader"] if frozen == "leader" else coordinators["relay"][0]
    t_freeze = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    errs = w.errors(range(n), within=SLACK * FROZEN_RAISE_WITHIN_S)
    own = range(2) if frozen == "leader" else range(2, 4)
    for rank, e in errs.items():
        context = f"rank {rank} raised {e}; {w.describe()}"
        assert e["t"] - t_freeze < SLACK * FROZEN_RAISE_WITHIN_S, context
        if rank in own:  # it found the dead connection itself
            assert e["type"] == "CoordinatorLostError", context
            assert ("frozen or unreachable: no keepalive answer within 1.5 s"
                    in e["message"]), context
            assert (f"(pid {pid}) at " in e["message"] and "its process is stopped "
                    "(SIGSTOP or a debugger)" in e["message"]), context
        else:  # told by its own coordinator, which lost the link
            assert e["type"] in ("CoordinatorLostError", "PeerLostError"), context
            assert "no keepalive answer within 1.5 s" in e["message"], context
    rc = w.wait(SLACK * FROZEN_DDLRUN_EXIT_WITHIN_S)
    assert w.t_end - t_freeze < SLACK * FROZEN_DDLRUN_EXIT_WITHIN_S, w.t_end - t_freeze
    assert rc != 0
    # ddlrun names the stopped one, not another that exited because of it
    assert (f"pid {pid}) was lost: its process is stopped (SIGSTOP or a debugger)"
            in w.summary()), w.describe()
    assert_no_survivors(w.marker)


@pytest.mark.timeout(120)
def test_busy_ranks_are_not_lost_with_the_default_settings(world):
    """No false alarm: 4 ranks on this 2-core machine, default liveness settings; rank 1
    holds the GIL for 5 s in a C call, rank 2 runs gc.collect() over 3 million objects,
    rank 3 spins 4 s in a pure-Python loop. Every allreduce is exact and the job ends
    cleanly (the keepalive pings are answered by gRPC's own threads, without the GIL)."""
    w = world(4, "busy", {"gil": 5, "objects": 3_000_000, "spin": 4})
    rc = w.wait(100)
    assert rc == 0, w.describe()
    done = w.wait_for([f"{r}.ok" for r in range(4)], within=1)
    assert done["1.ok"]["result"]["gil_s"] >= 5.0, done
    assert "gc_s" in done["2.ok"]["result"] and done["3.ok"]["result"]["spin_s"] >= 4, done
    assert not any(w.read(f"{r}.err") for r in range(4)), w.describe()
    assert_no_survivors(w.marker)


# -- the leak check of conftest.py ---------------------------------------------------------

LEAKY_TESTS = r'''
import os, subprocess, sys, tempfile, time

def test_clean():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

def test_leaves_a_grandchild_with_the_marker():
    subprocess.run(["sh", "-c", "sleep 60 & exit 0"], start_new_session=True, check=True)

def test_leaves_a_shm_segment():
    open("/dev/shm/ddltest-leakcheck-" + os.environ["DDL_TEST_MARKER"], "w").close()

def test_leaves_a_temp_dir():
    tempfile.mkdtemp(prefix="ddl-")
'''


@pytest.mark.timeout(60)
def test_the_leak_check_catches_and_kills_leftovers(tmp_path):
    """Run the leak check of tests/conftest.py over tests that leave things behind."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('ddl_conftest', "
        f"{os.path.join(os.path.dirname(__file__), 'conftest.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "mod.LEAK_GRACE_S = 0.5  # these processes never exit on their own\n"
        # not ddl-*: a test running at the same time in another session (pytest-xdist's
        # other worker) would see a new, unheld ddl-* segment as its own leak
        "mod.SHM_PREFIX = 'ddltest-leakcheck-'\n"
        "_leak_check, pytest_unconfigure = mod._leak_check, mod.pytest_unconfigure\n")
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("DDL_TEST_MARKER",
                                                            "DDLTEST_OWNER")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=50)
    out = r.stdout + r.stderr
    assert "5 passed, 4 errors" in out, out
    assert re.search(r"ERROR at teardown of test_leaves_a_process.*?processes outlived the "
                     r"test: pid \d+ \(\S+ -c import time; time.sleep\(60\)\)", out, re.S), out
    assert re.search(r"ERROR at teardown of test_leaves_a_grandchild_with_the_marker.*?"
                     r"processes outlived the test: pid \d+ \(sleep 60\)", out, re.S), out
    assert re.search(r"ERROR at teardown of test_leaves_a_shm_segment.*?ddl segments left "
                     r"in /dev/shm: \['ddltest-leakcheck-", out, re.S), out
    assert re.search(r"ERROR at teardown of test_leaves_a_temp_dir.*?temp files left in "
                     r"\S+: \['ddl-", out, re.S), out
    for name in os.listdir("/dev/shm"):  # the segments are the test's to remove
        if name.startswith("ddltest-leakcheck-"):
            os.unlink(os.path.join("/dev/shm", name))
    time.sleep(0.2)
    for line in re.findall(r"pid (\d+) \(", out):  # the leak check killed them
        assert wait_dead(int(line), 2)
