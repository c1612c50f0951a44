"""The elastic launcher: ``ddlrun --min-np N --max-np M [--host-discovery-script PATH]``.

ddlrun starts workers (never coordinators: each world's ranks start their own, the new
rank 0 the leader) and serves the elastic rendezvous that forms every world. A world
(a *generation*) is the list of workers, in rank order, that answered ``join``:

1. At start, ddlrun starts ``-np`` workers (default ``--max-np``) on the free slots of the
   hosts that discovery lists; world 0 forms once all of them joined and there are at
   least ``--min-np``.
2. A worker that loses its world (a collective fails with PeerLostError or
   CoordinatorLostError: a rank died, a host's link broke) rolls back, leaves the world
   and joins again, naming the ranks it saw lost. ddlrun kills those workers if they
   still run (a frozen process, a host cut off), and a worker that exits non-zero or by a
   signal gets its host blacklisted (``--blacklist-cooldown-range``; its other workers
   stay). Once a worker of the ended world joined (it holds the committed state), ddlrun
   also starts workers on the free slots of hosts that are not blacklisted, up to
   ``--max-np`` (a lost worker's place is taken elsewhere, as horovodrun does). The next
   world forms once every live worker, old and new, joined.
3. When discovery lists a new host (or more slots), ddlrun starts workers there, up to
   ``--max-np``, and raises the *membership version*; rank 0 asks for it at each
   ``State.commit()``, so every rank raises HostsUpdatedInterrupt at the same commit and
   joins; the new workers are already waiting. A host that leaves the list has its
   workers released (told to exit at their next join).
4. Ranks: survivors keep their order (the host of the lowest old rank first), new workers
   follow; so rank 0 of a new world holds the committed state whenever anyone does.

The job succeeds once a worker of the current world returns from its training function
(exits 0) and the others follow; it fails when a change cannot complete within
``--elastic-timeout`` (the message names the workers waited for, or says that fewer than
``--min-np`` remain), after ``--reset-limit`` resets, or on SIGINT/SIGTERM. At the end
every worker's process group is stopped and nothing is left behind.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.core.process_group import signal_group, stop_group
from ddl.launcher._job import JobResult
from ddl.launcher._multihost import RemoteSettings, is_local
from ddl.launcher._output import Forwarder, write_line
from ddl.launcher._spawn import describe_exit, exit_code, spawn
from ddl.launcher.elastic.discovery import Blacklist, Discovery
from ddl.launcher.elastic.remote_hosts import RemoteHosts
from ddl.launcher.elastic.rendezvous import RendezvousLinks

DISCOVERY_INTERVAL_S = 1.0
TERM_GRACE_S = 5.0
FINISH_GRACE_S = 30.0  # after one worker of the world finished: the others' time to
RELEASE_GRACE_S = 10.0  # a released worker's time to exit before it is stopped
# a rank another saw lost gets this long to exit on its own (one leaving after an
# exception says how it ended: "exited with code 1") before it is killed as lost
LOST_GRACE_S = 2.0
WAIT_NOTE_S = 2.0  # a world short of --min-np workers this long says what it waits for
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


def generation_job_id(job_id: str, generation: int) -> str:
    return hashlib.sha256(f"{job_id}/{generation}".encode()).hexdigest()[:16]


class ElasticJob(RendezvousLinks, RemoteHosts):
    """One elastic job: start with :meth:`start`, :meth:`wait` for its result,
    :meth:`close` at the end; :meth:`stop` from a signal handler. ``starter``: how
    workers start (default: a process here, or over ssh on another host); a job with one
    places them by its own means, and the hosts' addresses are not probed."""

    def __init__(self, command: Sequence[str], *, min_np: int, max_np: int, np: int,
                 discovery: Discovery, blacklist: Blacklist, elastic_timeout: float,
                 reset_limit: Optional[int], start_timeout: float,
                 extra_env: Optional[Mapping[str, str]] = None,
                 remote: Optional[RemoteSettings] = None, verbose: bool = False,
                 timestamps: bool = False, stdout: Optional[IO[str]] = None,
                 stderr: Optional[IO[str]] = None, log_prefix: str = "ddlrun",
                 starter: Optional[Starter] = None):
        self.command = list(command)
        self.min_np, self.max_np, self.np = min_np, max_np, np
        self.discovery, self.blacklist = discovery, blacklist
        self.elastic_timeout, self.reset_limit = elastic_timeout, reset_limit
        self.start_timeout = start_timeout
        self._extra_env = dict(extra_env or {})
        self._remote = remote or RemoteSettings()
        self._starter = starter
        self._verbose = verbose
        self._out, self._err = stdout or sys.stdout, stderr or sys.stderr
        self._prefix = log_prefix
        self._forwarder = Forwarder(timestamps)
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._workers: Dict[int, _Worker] = {}
        self._stop_signal: Optional[int] = None
        self._closing = threading.Event()
        self.job_id = _auth.new_job_id()
        self._secret = _auth.new_secret()
        self._listener: Optional[socket.socket] = None
        self.address = ""
        self._hosts: Dict[str, int] = {}
        self._host_order: List[str] = []
        self.generation = -1
        self.members: List[int] = []  # worker indices of the current world, by rank
        self.history: List[int] = []  # the size of every world formed
        self._round_open_since: Optional[float] = time.monotonic()  # world 0 is due
        self._version = 0
        self._version_kinds: List[str] = []  # "added" | "removed", per version step
        self._finished_at: Optional[float] = None
        self._failure = ""  # why the job failed ("" while it has not)
        self._last_loss = ""  # the last worker lost, and how
        self._waiting_said = -1  # the generation whose wait for --min-np workers was said
        self._released_at: Dict[int, float] = {}
        self._lost_at: Dict[int, Tuple[float, int, str]] = {}  # worker -> (when, rank, why)
        self._blacklisted: set = set()
        self._gathers: Dict[int, Dict[int, object]] = {}
        # a worker's link to us answers TCP keepalive probes within this (0: no probes)
        self._link_timeout = _config.load({**os.environ, **self._extra_env}).keepalive_timeout
        self._addresses: Dict[str, str] = {}  # host -> the address its workers bind
        self._probed: set = set()  # hosts the discovery thread had probed (its own)
        self._probe_problem = ""

    # -- public -------------------------------------------------------------------------
    def start(self) -> None:
        """Listen for workers and start the first ones."""
        spans = any(not is_local(h) for h in self.discovery.find()) or bool(
            self.discovery.polled)
        bind = "0.0.0.0" if spans else "127.0.0.1"
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind, 0))
        self._listener.listen(128)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="ddlrun-elastic-accept").start()
        hosts, chosen = self._probe(self.discovery.find())
        self._addresses.update(chosen)
        self._update_hosts(hosts, initial=True)
        if self.discovery.problem:
            self._log(f"warning: {self.discovery.problem}")
        threading.Thread(target=self._discover, daemon=True,
                         name="ddlrun-elastic-discovery").start()
        threading.Thread(target=self._heartbeat, daemon=True,
                         name="ddlrun-elastic-heartbeat").start()

    def wait(self) -> JobResult:
        try:
            return self._loop()
        except BaseException:
            self._teardown()
            raise

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask :meth:`wait` to end the job (signal-safe: sets a flag only)."""
        self._stop_signal = signum

    @property
    def stop_signal(self) -> Optional[int]:
        return self._stop_signal

    def close(self) -> None:
        self._closing.set()
        self._teardown()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        self._forwarder.join(2.0)

    # -- the loop -------------------------------------------------------------------------
    def _loop(self) -> JobResult:
        while True:
            if self._stop_signal is not None:
                self._teardown()
                return JobResult(128 + self._stop_signal, summary=(
                    f"stopped by signal {self._stop_signal}; every worker was stopped"))
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                event = None
            if event is not None:
                self._handle(event)
            result = self._check()
            if result is not None:
                return result

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "connected":
            _, index, sock = event
            w = self._workers.get(index)
            if w is None or not w.live or w.sock is not None:
                sock.close()  # not a worker we started, or a second connection
                return
            w.sock = sock
            threading.Thread(target=self._read, args=(w, sock), daemon=True,
                             name=f"ddlrun-elastic-read {index}").start()
        elif kind == "message":
            _, index, message = event
            w = self._workers.get(index)
            if w is not None:
                self._on_message(w, message)
        elif kind == "closed":
            w = self._workers.get(event[1])
            if w is not None:
                w.sock = None
        elif kind == "unreachable":
            self._unreachable(self._workers[event[1]], event[2])
        elif kind == "exited":
            _, index, code = event
            self._on_exit(self._workers[index], code)
        elif kind == "hosts":
            self._update_hosts(event[1])
        elif kind == "addresses":
            self._addresses.update(event[1])

    def _on_message(self, w: _Worker, message: dict) -> None:
        op = message.get("op") if isinstance(message, dict) else None
        if op == "join":
            self._on_join(w, message)
        elif op == "allgather":
            self._on_allgather(w, message)
        elif op == "poll":
            known = int(message.get("version", 0))
            kinds = self._version_kinds[known:]
            self._reply(w, {"op": "version", "version": self._version,
                            "changed": bool(kinds),
                            "only_removed": bool(kinds) and all(k == "removed" for k in kinds)})
        else:
            self._log(f"warning: {w.label()} sent an unknown request {str(message)[:100]}")

    # -- worlds -----------------------------------------------------------------------------
    def _on_join(self, w: _Worker, message: dict) -> None:
        if w.state in ("released", "finished") or self._finished_at is not None:
            if w.live:  # a worker started just before the job finished: its exit is no loss
                w.state = "released"
                self._released_at[w.index] = time.monotonic()
            self._reply(w, {"op": "exit", "message": "the job finished" if
                            self._finished_at is not None else "ddlrun released it"})
            return
        if self._failure:
            self._reply(w, self._error_reply())
            return
        w.join = message
        if w.generation == self.generation and w.generation >= 0 and w.index in self.members:
            self._open_round(f"{w.label()} left world {self.generation}: "
                             f"{str(message.get('reason', ''))[:200]}")
            for rank in message.get("lost", []):
                self._drop_rank(int(rank), f"worker {w.index} saw rank {rank} lost")
        w.state = "running"

    def _drop_rank(self, rank: int, why: str) -> None:
        """A rank of the current world that another saw lost: kill it if it still runs
        (a frozen process, a host cut off) and stop waiting for it."""
        if not 0 <= rank < len(self.members):
            return
        lost = self._workers[self.members[rank]]
        if lost.live and lost.join is None:   # stopped in _check unless it exits first
            self._lost_at.setdefault(lost.index, (time.monotonic(), rank, why))

    def _stop_lost(self, now: float) -> None:
        """Kill the ranks others saw lost that neither exited nor joined within
        ``LOST_GRACE_S`` (frozen, or cut off)."""
        for index, (since, rank, why) in list(self._lost_at.items()):
            lost = self._workers[index]
            if not lost.live or lost.join is not None or lost.returncode is not None:
                del self._lost_at[index]
            elif now - since > LOST_GRACE_S:
                del self._lost_at[index]
                self._log(f"{lost.label()} (rank {rank} of world {self.generation}) was "
                          f"lost ({why}); stopping it")
                self._kill(lost)
                self._gone(lost, f"lost: {why}")

    def _open_round(self, why: str) -> None:
        if self._round_open_since is None:
            self._round_open_since = time.monotonic()
            self._log(f"world {self.generation} ends: {why}")
            self._fail_gathers(f"world {self.generation} ended: {why}")

    def _try_form(self) -> None:
        if self._round_open_since is None or self._failure or self._finished_at is not None:
            return
        if self.generation >= 0 and any(self._workers[i].live and self._workers[i].join
                                        is not None for i in self.members):
            # a world ended and a worker of it, with the committed state, joined the next:
            # free slots of allowed hosts get workers for that one (world 0 has its -np)
            self._fill(self.max_np)
        live = [w for w in self._workers.values() if w.live]
        if not live or any(w.join is None for w in live) or len(live) < self.min_np:
            return
        if self.reset_limit is not None and len(self.history) > self.reset_limit:
            self._fail(f"the workers changed {len(self.history)} times, more than "
                       f"--reset-limit {self.reset_limit}")
            return
        old_rank = {i: r for r, i in enumerate(self.members)}
        big = len(self._workers) + 1
        host_key: Dict[str, float] = {}
        for w in live:
            key = old_rank.get(w.index, big + self._host_rank(w.host))
            host_key[w.host] = min(host_key.get(w.host, key), key)
        ordered = sorted(live, key=lambda w: (host_key[w.host], old_rank.get(w.index, big),
                                              w.index))
        self.generation += 1
        self.members = [w.index for w in ordered]
        self.history.append(len(ordered))
        job_id = generation_job_id(self.job_id, self.generation)
        took = time.monotonic() - self._round_open_since
        self._round_open_since = None
        self._gathers = {}
        self._log(f"world {self.generation}: {len(ordered)} workers "
                  f"({', '.join(f'{w.index}@{w.host}' for w in ordered)}), formed in "
                  f"{took:.2f} s")
        for rank, w in enumerate(ordered):
            w.generation, w.rank, w.join = self.generation, rank, None
            self._reply(w, {"op": "assign", "generation": self.generation, "rank": rank,
                            "size": len(ordered), "job_id": job_id,
                            "version": self._version, "bind": self._addresses.get(w.host, "")})

    def _host_rank(self, host: str) -> int:
        return self._host_order.index(host) if host in self._host_order else len(
            self._host_order)

    def _on_allgather(self, w: _Worker, message: dict) -> None:
        generation = int(message.get("generation", -1))
        if generation != self.generation or self._round_open_since is not None \
                or w.index not in self.members:
            self._reply(w, {"op": "error", "message": f"world {generation} is over"})
            return
        seq = int(message.get("seq", 0))
        got = self._gathers.setdefault(seq, {})
        got[w.rank] = message.get("value")
        if len(got) == len(self.members):
            values = [got[r] for r in range(len(self.members))]
            del self._gathers[seq]
            for index in self.members:
                self._reply(self._workers[index], {"op": "values", "values": values})

    def _fail_gathers(self, why: str) -> None:
        for got in self._gathers.values():
            for rank in got:
                self._reply(self._workers[self.members[rank]], {"op": "error", "message": why})
        self._gathers.clear()

    # -- processes ----------------------------------------------------------------------------
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
        if w.stdin is not None:
            try:
                w.stdin.close()
            except OSError:
                pass
        w.proc.signal(signal.SIGKILL)

    def _update_hosts(self, hosts: Dict[str, int], initial: bool = False) -> None:
        now = time.monotonic()
        out = set(self.blacklist.hosts(now))
        back, self._blacklisted = self._blacklisted - out, out
        if hosts == self._hosts and not initial and not back:
            return
        for host in hosts:
            if host not in self._host_order:
                self._host_order.append(host)
        gone_hosts = [h for h in self._hosts if h not in hosts]
        self._hosts = dict(hosts)
        removed = 0
        for w in self._workers.values():
            if w.live and w.host in gone_hosts:
                w.state = "released"
                self._released_at[w.index] = time.monotonic()
                removed += 1
                if w.join is not None:
                    self._reply(w, {"op": "exit", "message": f"host {w.host} left the job"})
        if removed:
            self._log(f"host(s) {', '.join(gone_hosts)} left: {removed} worker(s) released")
            self._bump("removed")
            if any(self._workers[i].state == "released" for i in self.members):
                self._open_round(f"host(s) {', '.join(gone_hosts)} left")
        added = self._fill(self.np if initial else self.max_np)
        if added and not initial:
            self._bump("added")

    def _bump(self, kind: str) -> None:
        self._version += 1
        self._version_kinds.append(kind)

    def _fill(self, target: int) -> int:
        """Start workers on free slots of allowed hosts, up to ``target`` live ones."""
        if self._finished_at is not None or self._failure:
            return 0
        now = time.monotonic()
        live = [w for w in self._workers.values() if w.live]
        started = 0
        for host, slots in self._hosts.items():
            if not self.blacklist.allowed(host, now):
                continue
            used = {w.slot for w in live if w.host == host}
            for slot in range(slots):
                if len(live) + started >= target:
                    return started
                if slot not in used:
                    self._start_worker(host, slot)
                    started += 1
        return started

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

    # -- checks ------------------------------------------------------------------------------
    def _check(self) -> Optional[JobResult]:
        now = time.monotonic()
        self._stop_lost(now)
        self._try_form()
        for index, since in list(self._released_at.items()):
            w = self._workers[index]
            if w.returncode is not None:
                del self._released_at[index]
            elif now - since > RELEASE_GRACE_S + self.elastic_timeout:
                self._log(f"{w.label()} was released but did not exit; stopping it")
                self._kill(w)
                del self._released_at[index]
        if self._failure:
            return self._end(1, self._failure)
        live_count = sum(1 for w in self._workers.values() if w.live)
        if self._round_open_since is not None and live_count < self.min_np \
                and not self._can_grow(now):
            self._fail(f"fewer than --min-np {self.min_np} workers remain ({live_count}) and "
                       f"no host can bring more (no --host-discovery-script, and the hosts "
                       f"blacklisted for the rest of the job: "
                       f"{', '.join(self.blacklist.hosts(now)) or 'none'}); the last "
                       f"loss: {self._last_loss}")
            return self._end(1, self._failure)
        if (self._round_open_since is not None and live_count < self.min_np
                and self._waiting_said != self.generation
                and now - self._round_open_since > WAIT_NOTE_S):
            self._waiting_said = self.generation   # say it once, not only with --verbose
            self._log(f"world {self.generation + 1} waits: {live_count} worker(s) remain, "
                      f"fewer than --min-np {self.min_np}; waiting up to "
                      f"{self.elastic_timeout:g} s (--elastic-timeout) for hosts to bring "
                      f"more (blacklisted: {', '.join(self.blacklist.hosts(now)) or 'none'}); "
                      f"the last loss: {self._last_loss}")
        if self._round_open_since is not None and now - self._round_open_since \
                > self.elastic_timeout and not self._starting_in_time(now):
            live = [w for w in self._workers.values() if w.live]
            missing = [w.label() + (" (never joined: --start-timeout "
                                    f"{self.start_timeout:g} s)" if w.state == "starting"
                                    else "") for w in live if w.join is None]
            if missing:
                why = (f"the workers could not form world {self.generation + 1} within "
                       f"--elastic-timeout {self.elastic_timeout:g} s: waited for "
                       f"{', '.join(missing)}")
            else:
                why = (f"fewer than --min-np {self.min_np} workers remain ({len(live)}) and "
                       f"no host brought more within --elastic-timeout "
                       f"{self.elastic_timeout:g} s (blacklisted: "
                       f"{', '.join(self.blacklist.hosts(now)) or 'none'})")
            self._fail(why)
            return self._end(1, self._failure)
        if all(not w.live for w in self._workers.values()) and self._workers:
            if self._finished_at is not None:
                return JobResult(0, {w.index: exit_code(w.returncode or 0) for w in
                                     self._workers.values()})
            if self._round_open_since is None:
                self._fail("every worker is gone")
        if self._finished_at is not None and now - self._finished_at > FINISH_GRACE_S:
            left = [w.label() for w in self._workers.values() if w.live]
            self._fail(f"a worker finished but {', '.join(left)} did not within "
                       f"{FINISH_GRACE_S:g} s")
        return None

    def _starting_in_time(self, now: float) -> bool:
        """Whether a worker that never joined is still within --start-timeout of its
        start: starting Python and the framework (over ssh, too) is bounded by that, as
        in a fixed job, not by --elastic-timeout, the bound of a change (horovodrun's
        elastic timeout bounds the wait for hosts, not a worker's start)."""
        return any(w.state == "starting" and now - w.started_at <= self.start_timeout
                   for w in self._workers.values())

    def _can_grow(self, now: float) -> bool:
        """Whether more workers may still come: a discovery script, a blacklist that
        ends, or a free slot on an allowed host."""
        if self.discovery.polled or self.blacklist.cooldown is not None:
            return True
        used = {(w.host, w.slot) for w in self._workers.values() if w.live}
        return any(self.blacklist.allowed(h, now) and (h, s) not in used
                   for h, n in self._hosts.items() for s in range(n))

    def _fail(self, why: str) -> None:
        if self._failure:
            return
        self._failure = why
        for w in self._workers.values():
            if w.live and w.join is not None:
                self._reply(w, self._error_reply())

    def _error_reply(self) -> dict:
        live = sum(1 for w in self._workers.values() if w.live)
        return {"op": "error", "message": self._failure, "min_np": self.min_np,
                "available": live}

    def _end(self, code: int, why: str) -> JobResult:
        deadline = time.monotonic() + 5.0  # the workers join, get the error, and exit
        while time.monotonic() < deadline and any(w.returncode is None for w in
                                                  self._workers.values()):
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._handle(event)  # joins get the error; exits are recorded
        self._teardown()
        return JobResult(code, {w.index: exit_code(w.returncode) if w.returncode is not None
                                else -1 for w in self._workers.values()}, summary=why)

    def _teardown(self) -> None:
        running = [w for w in self._workers.values() if w.proc.poll() is None]
        for w in running:
            if w.stdin is not None:
                try:
                    w.stdin.close()
                except OSError:
                    pass
            w.proc.signal(signal.SIGTERM)
        threads = [threading.Thread(target=w.proc.stop, args=(TERM_GRACE_S,),
                                    daemon=True) for w in running]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * TERM_GRACE_S + 1)

    # -- threads -----------------------------------------------------------------------------





    def _discover(self) -> None:
        problem = ""
        while not self._closing.wait(DISCOVERY_INTERVAL_S):
            if not self.discovery.polled and self.blacklist.cooldown is None:
                continue
            hosts = self.discovery.find()
            if self.discovery.problem and self.discovery.problem != problem:
                self._log(f"warning: {self.discovery.problem}")
            problem = self.discovery.problem
            hosts, chosen = self._probe(hosts)
            if chosen:
                self._events.put(("addresses", chosen))
            self._events.put(("hosts", hosts))



    def _log(self, text: str, always: bool = False) -> None:
        """Say ``text`` (without --verbose: warnings, losses, failures and world changes)."""
        if always or self._verbose or text.startswith("warning") or "lost" in text \
                or text.startswith("world") or " left" in text:
            write_line(self._err, f"{self._prefix}: {text}")
