"""Elastic jobs across hosts: ``ddlrun --min-np/--max-np --host-discovery-script`` with
its workers started over ssh on test hosts made of network namespaces (tests/_netns.py;
the first host is reached by ssh on a management address the other hosts cannot reach,
so the job must find the address they reach each other on). Two jobs cover the
multi-host cases:

* one job that grows, loses a rank and loses its leader's host: 2 workers on ddlh1, the
  discovery script adds ddlh2 and this host, one slot each (the world grows to 4 at a
  commit), worker 1 kills itself (3 continue from the last commit), then the script
  drops ddlh1, the host of rank 0 (the workers on ddlh2 and here form a world whose
  rank 0 and leader coordinator are on ddlh2); the final model equals the reference
  computed here from the worlds' schedule;
* one job whose ddlh2 link is cut: its ranks are dropped, the 2 on ddlh1 finish, ddlrun
  exits 0, and nothing is left on either host (even while the link is still down).

They need root, iproute2 and openssh-server (CI installs them and runs as root);
elsewhere they skip and say why."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
from typing import Callable, List

import numpy as np
import pytest
from test_launcher_support import job_env

import _netns

WHY = _netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no test hosts: {WHY}")

# The training script: deterministic data, every event printed as a JSON line. The model
# after step s is w - 0.1 * mean over ranks r < size of grad(s, r, size, w): any world
# schedule (the first step of each world and its size) gives one exact result.
TRAIN = r"""
import json, os, signal, sys, time
import numpy as np
import ddl, ddl.elastic

args = json.loads(sys.argv[1])
me = int(os.environ["DDL_ELASTIC_WORKER"])
host = os.environ["DDL_HOSTNAME"]

def emit(kind, **kw):
    print("EVENT " + json.dumps(dict(kw, kind=kind, worker=me, host=host, t=time.time())),
          flush=True)

def grad(step, rank, size, w):
    return np.sin(np.arange(4.0) + step + 10 * rank) + 0.01 * size * w

def write_hosts(text):
    with open(args["hosts_file"] + ".tmp", "w") as f:
        f.write(text)
    os.replace(args["hosts_file"] + ".tmp", args["hosts_file"])

ddl.init()
state = ddl.elastic.ObjectState(step=0, w=np.zeros(4), worlds=[])

@ddl.elastic.run
def train(state):
    size, rank = ddl.size(), ddl.rank()
    if not state.worlds or state.worlds[-1][1] != size:
        state.worlds.append([state.step, size])
    first = state.step
    emit("world", rank=rank, size=size, step=state.step)
    while state.step < 2000:
        phase = args["phases"][len(state.worlds) - 1]
        if phase.get("final") and state.step >= first + args["final_steps"]:
            break
        if state.step >= first + phase.get("after", 1 << 30):
            if "kill_worker" in phase and me == phase["kill_worker"]:
                emit("kill", step=state.step)
                os.kill(os.getpid(), signal.SIGKILL)
            if "hosts" in phase and rank == 0:
                if open(args["hosts_file"]).read() != phase["hosts"]:
                    write_hosts(phase["hosts"])
                    emit("hosts", step=state.step, hosts=phase["hosts"])
            if phase.get("mark") and rank == 0:
                emit("mark", step=state.step)
        g = ddl.allreduce(grad(state.step, rank, size, state.w), name="g", op=ddl.Average)
        state.w = state.w - 0.1 * g
        state.step += 1
        time.sleep(args["sleep"])
        state.commit()
    return state.w

w = train(state)
emit("done", rank=ddl.rank(), size=ddl.size(), step=state.step, w=w.tolist(),
     worlds=state.worlds)
"""


def reference(worlds: List[List[int]], steps: int) -> np.ndarray:
    """The model after ``steps`` steps of TRAIN under ``worlds`` ([first step, size])."""
    w = np.zeros(4)
    for step in range(steps):
        size = [n for first, n in worlds if first <= step][-1]
        g = np.mean([np.sin(np.arange(4.0) + step + 10 * r) + 0.01 * size * w
                     for r in range(size)], axis=0)
        w = w - 0.1 * g
    return w


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = _netns.TestHosts(2, str(tmp_path_factory.mktemp("hosts")))
    yield h
    h.close()


def _namespace_leftovers(hosts) -> dict:
    """``{host: [command lines]}`` of the processes in each test host but its sshd."""
    out = {}
    for name in hosts.names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.split()
        left = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if cmd and not cmd.startswith(("sshd", "/usr/sbin/sshd")):
                left.append(f"{pid} {cmd[:150]}")
        if left:
            out[name] = left
    return out


class Job:
    """ddlrun running in the background; its output lines collected as they come."""

    def __init__(self, argv: List[str], env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher.cli"] + argv,
                                     env=env, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.out: List[str] = []
        self.err: List[str] = []
        self.events: List[dict] = []
        self._new: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out),
                                          daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err),
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self, pipe, lines: List[str]) -> None:
        for line in iter(pipe.readline, ""):
            lines.append(line.rstrip("\n"))
            if "EVENT {" in line:
                event = json.loads(line.split("EVENT ", 1)[1])
                self.events.append(event)
                self._new.put(event)

    def wait_for(self, match: Callable[[dict], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._new.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"no such event within {timeout:g} s:\n"
                                         + self.tail())
                continue
            if match(event):
                return event

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for t in self._threads:
                t.join(10)
        return code

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.err[-n:]) + "\n--- stdout\n" + "\n".join(self.out[-n // 2:])

    def driver_lines(self, text: str) -> List[str]:
        return [ln for ln in self.err if ln.startswith("ddlrun: ") and text in ln]


def _env(hosts, tmp_path) -> dict:
    env = job_env(tmp_path, DDL_SSH_COMMAND=hosts.ssh_command)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    return env


def _discovery(tmp_path, text: str) -> tuple:
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(text)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    return str(hosts_file), str(script)


def _formed(job: Job) -> List[tuple]:
    """(generation, size, took) of every world the driver formed."""
    out = []
    for ln in job.driver_lines("formed in"):
        m = re.search(r"world (\d+): (\d+) workers .* formed in ([0-9.]+) s", ln)
        out.append((int(m.group(1)), int(m.group(2)), float(m.group(3))))
    return out


GROWN = "ddlh1:2\nddlh2:1\nlocalhost:1\n"


@pytest.mark.timeout(300)
def test_grow_lose_a_rank_and_lose_the_leaders_host(hosts, tmp_path):
    hosts_file, discover = _discovery(tmp_path, "ddlh1:2\n")
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    args = {"hosts_file": hosts_file, "sleep": 0.05, "final_steps": 8, "phases": [
        {"after": 3, "hosts": GROWN},              # 2 on ddlh1: ddlh2 and this host join
        {"after": 3, "kill_worker": 1},            # 4: worker 1 (ddlh1) dies
        {"after": 3, "hosts": "ddlh2:1\nlocalhost:1\n"},  # 3: rank 0's host leaves
        {"final": True}]}                          # 2: on ddlh2 (rank 0) and this host
    job = Job(["-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script",
               discover, "--elastic-timeout", "60", "--start-timeout", "60", "--verbose",
               sys.executable, str(train), json.dumps(args)], _env(hosts, tmp_path))
    code = job.finish(240)
    assert code == 0, job.tail()
    assert [n for _, n, _ in _formed(job)] == [2, 4, 3, 2], job.tail()
    done = [e for e in job.events if e["kind"] == "done"]
    assert sorted(e["worker"] for e in done) == [2, 3], job.tail()
    worlds = done[0]["worlds"]
    assert [n for _, n in worlds] == [2, 4, 3, 2], worlds
    for e in done:
        # the survivors finished in a world of their own, whose rank 0 (on ddlh2) is the
        # lowest of their old ranks; the model is the schedule's, to rounding
        assert (e["host"], e["rank"]) == {2: ("ddlh2", 0), 3: ("localhost", 1)}[e["worker"]]
        assert e["size"] == 2 and e["worlds"] == worlds, e
        assert np.allclose(e["w"], reference(worlds, e["step"]), rtol=1e-10, atol=1e-12), (
            e, reference(worlds, e["step"]))
    # ssh reaches ddlh1 on its management address, which ddlh2 cannot reach: when ddlh2
    # (and this host) came, the probe chose the addresses all reach, and the grown world's
    # leader (on ddlh1) serves its peers there; the last world's leader is on ddlh2
    for host, address in (("ddlh1", "10.77.0.1"), ("ddlh2", "10.77.0.2"),
                          ("localhost", "10.77.0.254")):
        assert f"ddlrun: host {host} uses {address} (every other host reached it)" in \
            job.err, job.tail()
    leaders = [ln for ln in job.err if "ddl-coordinator: leader serving job" in ln]
    assert leaders[1].startswith("[0]<stderr>:") and "(size 4)" in leaders[1] \
        and "10.77.0.1:" in leaders[1], leaders
    assert leaders[-1].startswith("[2]<stderr>:") and "(size 2)" in leaders[-1], leaders
    assert _namespace_leftovers(hosts) == {}
    def after(kind: str, t: float, **match) -> float:
        """When the first ``kind`` event matching ``match`` came after ``t``."""
        return min(e["t"] for e in job.events if e["kind"] == kind and e["t"] >= t
                   and all(e.get(k) == v for k, v in match.items()))
    added = after("hosts", 0, hosts=GROWN)
    kill = after("kill", 0)
    left = after("hosts", 0, hosts="ddlh2:1\nlocalhost:1\n")
    print(f"\nworlds formed (generation, size, s): {_formed(job)}; training again "
          f"{after('world', added, size=4) - added:.2f} s after ddlh2 was listed, "
          f"{after('world', kill, size=3) - kill:.2f} s after the kill, "
          f"{after('world', left, size=2) - left:.2f} s after ddlh1 was delisted")


@pytest.mark.timeout(300)
def test_cutting_a_hosts_link_drops_its_ranks_and_the_rest_finish(hosts, tmp_path):
    hosts_file, discover = _discovery(tmp_path, "ddlh1:2\nddlh2:2\n")
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    args = {"hosts_file": hosts_file, "sleep": 0.05, "final_steps": 8, "phases": [
        {"after": 5, "mark": True},  # 4 on ddlh1 and ddlh2: the test cuts ddlh2's link
        {"final": True}]}            # 2 on ddlh1
    job = Job(["-np", "4", "--min-np", "2", "--max-np", "4", "--host-discovery-script",
               discover, "--elastic-timeout", "60", "--start-timeout", "60",
               "--liveness-timeout-seconds", "4", "--network-interface", "eth0",
               sys.executable, str(train), json.dumps(args)], _env(hosts, tmp_path))
    link = hosts.veth("ddlh2")
    try:
        job.wait_for(lambda e: e["kind"] == "mark", 120)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        cut = time.time()
        code = job.finish(120)
        left = _namespace_leftovers(hosts)
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _namespace_leftovers(hosts)
        gone = time.time()
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        if job.proc.poll() is None:
            job.proc.kill()
            job.finish(10)
    assert code == 0, job.tail()
    assert left == {}, (left, job.tail())
    assert [n for _, n, _ in _formed(job)] == [4, 2], job.tail()
    resumed = min(e["t"] for e in job.events if e["kind"] == "world" and e["size"] == 2)
    # dropped within the liveness promise (keepalive: ~3 s), with room for a busy machine
    assert resumed - cut < 12, (resumed - cut, job.tail())
    assert len(job.driver_lines("its link to ddlrun timed out")) == 2, job.tail()
    print(f"\nworlds formed (generation, size, s): {_formed(job)}; the survivors trained "
          f"again {resumed - cut:.2f} s after the cut; the cut host's processes were gone "
          f"{gone - cut:.1f} s after it")
    done = [e for e in job.events if e["kind"] == "done"]
    assert sorted(e["worker"] for e in done) == [0, 1], job.tail()
    for e in done:
        assert e["host"] == "ddlh1" and e["worlds"][-1][1] == 2, e
        assert np.allclose(e["w"], reference(e["worlds"], e["step"]), rtol=1e-10,
                           atol=1e-12), e
