"""The elastic launcher: ``ddlrun --min-np N --max-np M [--host-discovery-script PATH]``.

ddlrun starts workers (never coordinators: each world's ranks start their own, the new
rank 0 the leader) and serves the elastic rendezvous that forms every world. A world
(a *generation*) is the list of workers, in rank order, that answered ``join``:

1. At start, ddlrun starts ``-np`` workers (default ``--max-np``) on the free slots of the
   hosts that discovery lists; world 0 forms once all of them joined and there are at
   least ``--min-np``.
2. A worker that loses its world (a collective fails with PeerLostError or
   CoordinatorLostError: a rank died, a host's link broke) rolls back, leaves the world
   and joins again, naming the ranks it saw lost (those not yet joined then). ddlrun
   kills them if they still run 2 s later (a frozen process, a host cut off, or two
   ranks that saw each other lost), and a worker that exits non-zero or by a signal
   gets its host blacklisted (``--blacklist-cooldown-range``; its other workers
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

This module holds the job's state, its public face and its event loop; the job's other
parts are mixins beside it: the worlds (:mod:`.worlds`), the worker processes
(:mod:`.workers`), the hosts and slots (:mod:`.slots`), the loop's checks and the job's
end (:mod:`.checks`), the workers' links (:mod:`.rendezvous`) and the remote hosts
(:mod:`.remote_hosts`).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.launcher._job import JobResult
from ddl.launcher._multihost import RemoteSettings, is_local
from ddl.launcher._output import Forwarder, write_line
from ddl.launcher.elastic.checks import JobChecks
from ddl.launcher.elastic.discovery import Blacklist, Discovery
from ddl.launcher.elastic.remote_hosts import RemoteHosts
from ddl.launcher.elastic.rendezvous import RendezvousLinks
from ddl.launcher.elastic.slots import HostSlots
# re-exported: the starter's interface, which engines reach as ddl._client_api.elastic_driver
from ddl.launcher.elastic.workers import (LAUNCHER_PLACEHOLDER, Starter, WorkerProcess,
                                          WorkerProcesses, _Worker)
from ddl.launcher.elastic.worlds import Worlds

__all__ = ["ElasticJob", "WorkerProcess", "Starter", "LAUNCHER_PLACEHOLDER"]


class ElasticJob(Worlds, WorkerProcesses, HostSlots, JobChecks, RendezvousLinks, RemoteHosts):
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

    def _log(self, text: str, always: bool = False) -> None:
        """Say ``text`` (without --verbose: warnings, losses, failures and world changes)."""
        if always or self._verbose or text.startswith("warning") or "lost" in text \
                or text.startswith("world") or " left" in text:
            write_line(self._err, f"{self._prefix}: {text}")
