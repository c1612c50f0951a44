"""The worker processes of :class:`~ddl.launcher.elastic.driver.ElasticJob`: starting
one on a slot, its exit or its loss, and stopping them all at the end.

A worker starts as a process here, through ssh on another host (:mod:`.remote_hosts`),
or by the job's ``starter`` (``ddl.ray``: a Ray actor); the driver holds each as a
:class:`WorkerProcess` and a thread waits for its exit (an ``exited`` event on the job's
queue). A worker that exits 0 as a member of the current world finishes the job; one
that fails (it exits non-zero or by a signal, its link times out, or others saw it lost)
is *gone*: its host is blacklisted, and its world ends if it was in it. At the end every
worker's process group gets TERM, and KILL after :data:`TERM_GRACE_S`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Dict, Optional

from ddl.core.process_group import signal_group, stop_group
from ddl.launcher._multihost import is_local
from ddl.launcher._spawn import describe_exit, spawn

TERM_GRACE_S = 5.0
LAUNCHER_PLACEHOLDER = "{launcher}"  # the remote agent puts ddlrun's address there


class WorkerProcess:
    """A started worker, as the driver sees it: the default wraps its process here or
    its ssh (signals reach the process group it leads); ``ElasticJob(starter=...)``
    returns its own kind (``ddl.ray``: a Ray actor that runs the worker). ``wait()`` and
    ``poll()`` give the exit status (negative: killed by that signal), ``signal(signum)``
    reaches everything the worker started, ``stop(grace_s)`` ends it (TERM, KILL after
    ``grace_s``) and returns once it is gone; ``stdout``/``stderr`` are byte streams to
    forward (None: the worker's output goes elsewhere); ``name`` goes into messages."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.stdout, self.stderr = proc, proc.stdout, proc.stderr
        self.name = f"pid {proc.pid}"

    def wait(self) -> int:
        return self.proc.wait()

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        signal_group(self.proc, signum)

    def stop(self, grace_s: float) -> None:
        stop_group(self.proc, grace_s)


# starter(index, host, slot, env) -> the started worker, with env its whole environment
# (the job secret included: the starter's to protect on its way)
Starter = Callable[[int, str, int, Dict[str, str]], WorkerProcess]


@dataclass
class _Worker:
    index: int
    host: str
    slot: int
    proc: WorkerProcess
    remote: bool
    stdin: Optional[IO[bytes]] = None
    sock: Optional[socket.socket] = None
    state: str = "starting"  # starting | running | gone | finished | released
    generation: int = -1  # the last world it was placed in
    rank: int = -1  # its rank there
    returncode: Optional[int] = None
    join: Optional[dict] = None  # a join waiting for the next world
    started_at: float = field(default_factory=time.monotonic)

    @property
    def live(self) -> bool:
        return self.state in ("starting", "running")

    def label(self) -> str:
        return f"worker {self.index} (host {self.host}, {self.proc.name})"


class WorkerProcesses:
    """Mixed into ElasticJob (uses its ``_workers``, ``_events``, ``_starter``, ``command``,
    ``_extra_env``, ``_remote``, ``address``, ``job_id``, ``_secret``, ``_out``, ``_err``,
    ``_forwarder``, ``members``, ``generation``, ``blacklist``, ``_finished_at``,
    ``_failure``, ``_last_loss``, ``_log``, ``_reply``, ``_open_round``, ``_spawn_remote``
    and ``_interface_address``)."""

    def _start_worker(self, host: str, slot: int) -> None:
        index = len(self._workers)
        env = {k: v for k, v in os.environ.items()
               if k not in ("DDL_HOSTS", "DDL_HOSTFILE", "DDL_NUM_PROC")}
        env.update(self._extra_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        port = self.address.rpartition(":")[2]
        remote = not is_local(host)
        env.update({"DDL_JOB_ID": self.job_id, "DDL_JOB_SECRET": self._secret,
                    "DDL_ELASTIC_WORKER": str(index), "DDL_HOSTNAME": host,
                    "DDL_ELASTIC_ADDR": f"{LAUNCHER_PLACEHOLDER if remote else '127.0.0.1'}"
                                        f":{port}"})
        for name in ("DDL_RANK", "DDL_SIZE", "DDL_COORDINATOR_ADDR", "DDL_REPORT_DIR"):
            env.pop(name, None)
        if not remote and self._remote.interfaces and not env.get("DDL_BIND_ADDRESS"):
            env["DDL_BIND_ADDRESS"] = self._interface_address()
        streams = {"stdout": (f"[{index}]<stdout>:", self._out),
                   "stderr": (f"[{index}]<stderr>:", self._err)}
        if self._starter is not None:
            proc, stdin = self._starter(index, host, slot, env), None
        elif remote:
            popen, stdin = self._spawn_remote(host, env, index)
            proc = WorkerProcess(popen)
        else:
            proc, stdin = WorkerProcess(spawn(self.command, env)), None
        w = _Worker(index, host, slot, proc, remote, stdin)
        self._workers[index] = w
        self._log(f"started worker {index} on host {host} (slot {slot}, {proc.name})")
        for name, (prefix, dest) in streams.items():
            if getattr(proc, name) is not None:
                self._forwarder.add(getattr(proc, name), prefix, dest)
        threading.Thread(target=self._reap, args=(w,), daemon=True,
                         name=f"ddlrun-elastic-reap {index}").start()

    def _reap(self, w: _Worker) -> None:
        self._events.put(("exited", w.index, w.proc.wait()))

    def _on_exit(self, w: _Worker, code: int) -> None:
        w.returncode = code
        if w.state == "released":
            self._log(f"{w.label()} (released) exited")
            w.state = "gone"
            return
        if w.state == "gone":
            return
        if code == 0 and w.index in self.members:
            w.state = "finished"
            if self._finished_at is None:
                self._finished_at = time.monotonic()
                self._log(f"{w.label()} finished; the job ends when the others do")
                for other in self._workers.values():  # waiting newcomers have no work
                    if other.live and other.join is not None:
                        other.state = "released"
                        self._reply(other, {"op": "exit", "message": "the job finished"})
            return
        self._gone(w, describe_exit(code))

    def _gone(self, w: _Worker, how: str) -> None:
        """``w`` failed: blacklist its host, and end its world if it was in it."""
        if w.state == "gone":
            return
        was_member = w.index in self.members and w.generation == self.generation
        w.state, w.join = "gone", None
        if self._failure:  # the job is ending: workers exit because it does
            return
        seconds = self.blacklist.fail(w.host, time.monotonic())
        self._last_loss = f"{w.label()} {how}"
        out = "for the rest of the job" if seconds == float("inf") else f"for {seconds:.0f} s"
        self._log(f"{w.label()} {how}; host {w.host} gets no new worker {out}", always=True)
        if self._finished_at is not None:
            self._failure = self._failure or f"{w.label()} {how} after the job finished"
            return
        if was_member:
            self._open_round(f"{w.label()} {how}")

    def _unreachable(self, w: _Worker, why: str) -> None:
        """``w``'s link to us timed out: its host is unreachable (cut off, or down), so
        it can never join again; stop its ssh (its agent stops it, see
        :mod:`ddl.launcher.remote`) and stop waiting for it."""
        if w.live:
            self._log(f"{w.label()} was lost: its link to ddlrun timed out ({why}); "
                      f"stopping it")
            self._kill(w)
            self._gone(w, "was unreachable")

    def _kill(self, w: _Worker) -> None:
        self._signal(w, signal.SIGKILL)

    @staticmethod
    def _signal(w: _Worker, signum: int) -> None:
        """Close ``w``'s stdin (a remote worker's agent stops it then) and signal it."""
        if w.stdin is not None:
            try:
                w.stdin.close()
            except OSError:
                pass
        w.proc.signal(signum)

    def _teardown(self) -> None:
        running = [w for w in self._workers.values() if w.proc.poll() is None]
        for w in running:
            self._signal(w, signal.SIGTERM)
        threads = [threading.Thread(target=w.proc.stop, args=(TERM_GRACE_S,),
                                    daemon=True) for w in running]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * TERM_GRACE_S + 1)
