"""Process-wide runtime: ``init``, ``shutdown`` and topology.

``init()`` finds its coordinator from the launcher's environment (``DDL_COORDINATOR_ADDR``,
``DDL_RANK``, ``DDL_SIZE``, ``DDL_JOB_ID``, ``DDL_JOB_SECRET``). With no launcher it runs
a size-1 job whose coordinator is embedded in the process. It then opens the data-plane
listener, registers (rendezvous with every rank, bounded by ``DDL_START_TIMEOUT``) and
starts the engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.core import faults as _faults
from ddl.core import report as _report
from ddl.core.cpus import usable_cpus
from ddl.core.errors import (BootstrapError, ConfigError, DDLError, DDLTimeoutError, FatalError,
                             NotInitializedError, ShutdownError, with_phase)
from ddl.dataplane.backends import Backends, CycleChannel, CycleSetup, DataPlane
from ddl.dataplane.backends.shm import ShmGroups
from ddl.dataplane.transports.base import Group
from ddl.runtime.control import ControlClient
from ddl.runtime.engine import ROOT_CAUSE_WAIT_S, SECONDARY_DEPARTURE, Engine
from ddl.runtime.execute import Executor
from ddl.runtime.timeline import timeline
from ddl.startup import bootstrap as _bootstrap
from ddl.startup import heap as _heap
from ddl.startup.embedded import EmbeddedCoordinator
from ddl.startup.start import Start

log = logging.getLogger("ddl")


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    hostname: str


class Runtime:
    """Everything one initialized worker holds."""

    def __init__(self, cfg: _config.Config, start: Optional[Start] = None):
        self.config = cfg
        self._embedded: Optional[EmbeddedCoordinator] = None
        self.names = _NameCounter()
        self.process_sets: Dict[Tuple[int, ...], int] = {}  # sets this rank added: ranks -> id
        # what an MPI start left to this rank: a coordinator daemon it owns, files
        self._start = start
        self.mpi = start.mpi if start is not None else None

        address, job_id, secret = cfg.coordinator_addr, cfg.job_id, cfg.job_secret
        # joined a job of a launcher's (ddlrun, ddl.run), not one it started itself
        self.launched = bool(address) and (start is None or (start.coordinator is None
                                                             and start.mpi is None))
        if address:
            if cfg.rank is None or cfg.size is None:
                raise ConfigError("DDL_COORDINATOR_ADDR is set but DDL_RANK or DDL_SIZE is "
                                  "not; start the job with ddlrun", variable="DDL_RANK")
            if not job_id or not secret:
                raise ConfigError("DDL_JOB_ID and DDL_JOB_SECRET must be set with "
                                  "DDL_COORDINATOR_ADDR", variable="DDL_JOB_SECRET")
            rank, size = cfg.rank, cfg.size
        else:
            if cfg.size not in (None, 1):
                raise ConfigError(
                    f"DDL_SIZE={cfg.size} but DDL_COORDINATOR_ADDR is not set; a job of more "
                    f"than one process must be started by ddlrun (or ddl.run)",
                    variable="DDL_SIZE", value=str(cfg.size))
            rank, size = 0, 1
            job_id, secret = _auth.new_job_id(), _auth.new_secret()
            self._embedded = EmbeddedCoordinator(self.config, job_id, secret)
            address = self._embedded.address
        if not 0 <= rank < size:
            raise ConfigError(f"DDL_RANK={rank} is outside [0, DDL_SIZE={size})",
                              variable="DDL_RANK", value=str(rank))
        hostname = cfg.hostname or socket.gethostname()

        from ddl.dataplane.transports.tcp import TcpTransport  # the data plane loads with the job

        self.engine: Optional[Engine] = None
        self.backends: Optional[Backends] = None
        self.shm_groups: Optional[ShmGroups] = None
        self._cycle_channel: Optional[CycleChannel] = None
        self._cycle_backends: Optional[Backends] = None
        # the response cache's cycles over TCP run on connections of their own
        self._cycle_transport: Optional[TcpTransport] = None
        if cfg.cache_capacity > 0 and size > 1:
            self._cycle_transport = TcpTransport(
                rank, size, _auth.secret_bytes(secret), f"{job_id}/cycles",
                bind_address=cfg.bind_address, abort_check=self._check_cycles,
                connect_timeout=cfg.start_timeout)
        self.transport = TcpTransport(rank, size, _auth.secret_bytes(secret), job_id,
                                      bind_address=cfg.bind_address,
                                      abort_check=self._check_abort,
                                      connect_timeout=cfg.start_timeout)
        self.control = ControlClient(address, job_id, secret, rank,
                                     heartbeat_interval=cfg.heartbeat_interval,
                                     liveness_timeout=cfg.liveness_timeout,
                                     keepalive_interval=cfg.keepalive_interval,
                                     keepalive_timeout=cfg.keepalive_timeout,
                                     report_dir=cfg.report_dir)
        phase = "opening its data-plane listeners"
        try:
            data_address = self.transport.listen()
            cycle_address = (self._cycle_transport.listen()
                             if self._cycle_transport is not None else "")
            phase = "registering with the coordinator (rendezvous)"
            if _faults.ACTIVE is not None: _faults.hit("init.register")
            reply = self.control.register(size=size, hostname=hostname, pid=os.getpid(),
                                          data_address=data_address, timeout=cfg.start_timeout,
                                          cycle_address=cycle_address)
            phase = "opening its control stream"
            if _faults.ACTIVE is not None: _faults.hit("init.registered")
            self.transport.set_peers({p.rank: p.data_address for p in reply.peers})
            self.topology = Topology(rank, size, reply.local_rank, reply.local_size,
                                     reply.cross_rank, reply.cross_size, reply.is_homogeneous,
                                     hostname)
            self.peers = {p.rank: p for p in reply.peers}
            hosts = {p.rank: p.hostname for p in reply.peers}
            self.shm_groups = ShmGroups(cfg.transport, job_id, _auth.secret_bytes(secret),
                                        rank, hosts, self._check_abort,
                                        cma=cfg.shm_cma == "auto")
            self.backends = Backends(DataPlane(rank, cfg, self.transport, self.shm_groups,
                                               hosts, abort_check=self._check_abort))
            executor = Executor(rank, self.backends, cfg.collective_timeout)
            self.engine = Engine(rank, executor, self.control.send,
                                 lambda error: _report.write(cfg.report_dir, rank, error),
                                 self._failed_locally)
            # The stream opens before the rest of start-up, so that from here on a rank
            # lost or frozen (its heartbeats stop) fails every rank's init by name.
            self.control.start_stream(self.engine.on_message, self.engine.on_lost)
            phase = "setting up the response cache's cycles"

            def on_phase(text: str) -> None:
                nonlocal phase
                phase = text

            if reply.cache_capacity > 0 and size > 1:
                self._cycle_channel = self.backends.cycle_channel(CycleSetup(
                    Group.of(range(size), rank), reply.cache_capacity, job_id,
                    _auth.secret_bytes(secret), hostname, self._check_cycles,
                    self._cycle_transport, {p.rank: p.cycle_address for p in reply.peers},
                    time.monotonic() + cfg.start_timeout, on_phase))
            channel = self._cycle_channel
            if self._cycle_transport is not None and (channel is None
                                                      or not channel.uses_transport):
                self._cycle_transport.close()  # nobody dials it
                self._cycle_transport = None
            if channel is not None:
                self._start_cycles(channel, reply)
            if cfg.timeline:
                start_timeline(cfg.timeline, cfg.timeline_mark_cycles, rank)
        except BaseException as exc:
            error = self._init_error(exc, phase)
            if error is not exc:
                self.close(reason=SECONDARY_DEPARTURE + str(error))
                raise error from None
            self.close(reason=f"the process failed in ddl.init() while {phase}: "
                              f"{type(exc).__name__}: {exc}"[:500])
            raise

    def _init_error(self, exc: BaseException, phase: str) -> BaseException:
        """What ``ddl.init()`` raises for ``exc``: when another rank (or a coordinator)
        broke the start, the error naming it (the coordinator's, waited for briefly when
        the data plane noticed first), with the phase this rank was in; ``exc`` itself
        when this rank failed on its own. Records a fatal-error report for the launcher."""
        if not isinstance(exc, DDLError):
            return exc
        error: BaseException = exc
        engine = self.engine
        if engine is not None and exc is not engine.fatal:
            # the data plane may see a peer give up before the coordinator's abort arrives
            error = engine.wait_fatal(ROOT_CAUSE_WAIT_S) or exc
        origin = getattr(error, "rank", -1)
        if not isinstance(error, (FatalError, DDLTimeoutError)) or origin == self.config.rank:
            return exc
        if engine is None or engine.fatal is None:  # the engine records its own
            _report.write(self.config.report_dir, self.config.rank, error)
        return with_phase(error, f"ddl.init() failed on rank {self.config.rank} while "
                                 f"{phase}")

    def _start_cycles(self, channel: CycleChannel, reply) -> None:
        """Run the response cache's cycles on ``channel`` (the backends chose it)."""
        from ddl.runtime.cache import ResponseCache
        from ddl.runtime.cycles import CycleRunner

        cfg, rank = self.config, self.topology.rank
        cache = ResponseCache(reply.cache_capacity)
        votes, plane = channel.votes, channel.plane
        # the cycles' collectives: the same backends, on the cycles' own channel
        self._cycle_backends = Backends(plane)
        cycle_executor = Executor(rank, self._cycle_backends, cfg.collective_timeout)
        engine = self.engine

        def run(response, entries, execute=cycle_executor) -> bool:
            return engine.run_response(response, entries, execute)

        threshold = int(reply.fusion_threshold_bytes)

        def fusion_threshold() -> int:  # the autotuner's, once it stamped one
            return cfg.fusion_threshold if cfg.tuning_id else threshold

        engine.cache, engine.cycles = cache, CycleRunner(
            rank, cache, votes, run, engine.take, engine.resend, engine.cycle_error,
            fusion_threshold, cfg.collective_timeout,
            cfg.stall_check_time, cfg.stall_shutdown_time,
            cycle_time_s(cfg.cycle_time_ms, self.topology.local_size))

    def _check_cycles(self) -> None:
        """The cycles' abort check: the job's fatal error, and their own stalls."""
        self._check_abort()
        cycles = self.engine.cycles if self.engine is not None else None
        if cycles is not None:
            cycles.check_stall()

    def _failed_locally(self, what: str) -> None:
        """This rank failed inside a collective (not because of another rank): tell the
        coordinator, which tells the others (its peers may be stuck mid-collective)."""
        self.control.close(reason=f"the process failed {what}", timeout=1.0)

    def _check_abort(self) -> None:
        if self.engine is not None:
            self.engine.check_abort()

    def close(self, reason: str = "shutdown", coordinator_wait: Optional[float] = None) -> None:
        """Leave the job: goodbye, stop threads, close sockets, stop an embedded server.
        ``coordinator_wait``: how long a coordinator this rank owns may take to exit
        (default :data:`ddl.startup.coordinator.EXIT_WAIT_S`)."""
        timeline.stop()
        if self.engine is not None:
            self.engine.stop()
            if self.engine.cycles is not None:
                self.engine.cycles.stop()
        self.control.close(reason=reason)
        # the device data plane's segments and communicators (the executors have stopped)
        for backends in (self.backends, self._cycle_backends):
            if backends is not None:
                try:
                    backends.close()
                except Exception as exc:   # what stays is the process's, until it ends
                    log.warning("ddl: releasing the device data plane on shutdown failed: "
                                 "%s: %s", type(exc).__name__, exc)
        if self.shm_groups is not None:
            self.shm_groups.close()
        if self._cycle_channel is not None:
            self._cycle_channel.close()
            self._cycle_channel = None
        if self._cycle_transport is not None:
            self._cycle_transport.close()
        self.transport.close()
        if self._embedded is not None:
            self._embedded.close()
            self._embedded = None
        start, self._start = self._start, None
        if start is not None:
            if start.coordinator is not None:  # exits once the node's ranks said goodbye
                if coordinator_wait is None:
                    start.coordinator.close()
                else:
                    start.coordinator.close(timeout=coordinator_wait)
            if start.cleanup is not None:
                start.cleanup()


class _NameCounter:
    """Deterministic names for calls without ``name=``: ``<op>.<n>`` per process set."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = {}

    def next(self, op: str, process_set_id: int) -> str:
        with self._lock:
            key = (op, process_set_id)
            n = self._next.get(key, 0)
            self._next[key] = n + 1
        return f"{op}.noname.{n}"


def start_timeline(path: str, mark_cycles: bool = False, rank: Optional[int] = None) -> None:
    """Record a Chrome-trace timeline of this rank's collectives into ``path`` (open it in
    Perfetto or chrome://tracing). ``{rank}`` in ``path`` is replaced by the rank and
    every rank writes its own file; without it only rank 0 writes. Local to each rank."""
    if rank is None:
        rank = runtime().topology.rank
    if "{rank}" in path:
        path = path.replace("{rank}", str(rank))
    elif rank != 0:
        return
    timeline.start(path, pid=rank, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Stop recording and close the timeline file (it is valid JSON at every moment)."""
    timeline.stop()


_state_lock = threading.RLock()
_runtime: Optional[Runtime] = None


def init(comm: Any = None) -> None:
    """Join the job (idempotent): :func:`ddl.init` without its process sets (its
    docstring says how each launcher's ranks find the job, and what ``comm`` is)."""
    global _runtime
    with _state_lock:
        if _runtime is not None:
            return
        cfg = _config.load()
        level = _config.log_level(cfg)
        logging.getLogger("ddl").setLevel(level)
        if level < logging.WARNING:
            logging.basicConfig(level=level)
        if cfg.notes and not cfg.launcher_pid and not cfg.rank:  # ddlrun said them already
            for note in cfg.notes:
                log.warning("ddl: %s", note)
        if comm is None and cfg.coordinator_addr and cfg.job_id == _left_job:
            raise BootstrapError(
                f"ddl.init() after ddl.shutdown() is not supported in a job started by ddlrun "
                f"or ddl.run: rank {cfg.rank} already left job {cfg.job_id}, whose "
                f"coordinator ends once every rank has left. Call ddl.init() once, at the "
                f"start, and ddl.shutdown() (if at all) once, at the end; to run jobs one "
                f"after another, start each with its own ddlrun (or ddl.run)",
                rank=-1 if cfg.rank is None else cfg.rank,
                host=cfg.hostname or socket.gethostname())
        _heap.retain(cfg.malloc_retain_mb * _config.MiB)
        start = _bootstrap.resolve(cfg, comm)
        try:
            _runtime = Runtime(start.config, start)
        except BaseException:
            if start.coordinator is not None:
                start.coordinator.close(timeout=0)
            if start.cleanup is not None:
                start.cleanup()
            raise
        _watch_uncaught_exceptions()
        t = _runtime.topology   # for scripts that read what Horovod's launchers set
        os.environ.update(_config.horovod_identity(
            rank=t.rank, size=t.size, local_rank=t.local_rank, local_size=t.local_size,
            cross_rank=t.cross_rank, cross_size=t.cross_size, hostname=t.hostname))


def shutdown() -> None:
    """Leave the job; pending calls raise ShutdownError. Safe to call twice or before init.

    In a job started by ``ddlrun`` or ``ddl.run`` a later ``init()`` raises
    BootstrapError at once (the job's coordinator ends once every rank has left); a
    process without a launcher may init again (a new job of one)."""
    _shutdown("shutdown")


# The job this process left by shutdown() when a launcher started it: its coordinator
# is gone (or going) for good, so init() refuses to join it again.
_left_job: Optional[str] = None


def _shutdown(reason: str) -> None:
    global _runtime, _left_job
    with _state_lock:
        rt, _runtime = _runtime, None
        if rt is not None and rt.launched:
            _left_job = rt.config.job_id
    if rt is not None:
        rt.close(reason=reason)


def leave_world(reason: str) -> None:
    """An elastic job's reset (:mod:`ddl.elastic`): leave this world at once (its
    coordinators get a second to exit), so that ``init()`` can join the next one."""
    global _runtime
    with _state_lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.close(reason=reason, coordinator_wait=1.0)


_uncaught: Optional[str] = None  # the uncaught exception the process is dying of


def _watch_uncaught_exceptions() -> None:
    """Chain ``sys.excepthook`` so the goodbye at exit can say what killed the process
    (the leader tells the other ranks)."""
    previous = sys.excepthook
    if getattr(previous, "_ddl_hook", False):
        return

    def hook(exc_type, exc, tb):  # noqa: ANN001
        global _uncaught
        _uncaught = f"{exc_type.__name__}: {exc}"[:500]
        previous(exc_type, exc, tb)

    hook._ddl_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# the default cycle time where the host has fewer than two CPUs per local rank
CROWDED_CYCLE_TIME_MS = 50.0


def cycle_time_s(cycle_time_ms: Optional[float], local_size: int) -> float:
    """The cycles' cycle time in seconds: ``DDL_CYCLE_TIME_MS``, or by default 0 where
    this process may run on two CPUs per local rank (one computes, one moves the bytes
    of asynchronous calls), else :data:`CROWDED_CYCLE_TIME_MS`: a background thread that
    starts calls at once there only takes a CPU from some rank's computation, and the
    waiting thread does the work anyway, fused into fewer cycles (the MLP of
    docs/performance.md trains 1.4 times as fast on 2 CPUs)."""
    if cycle_time_ms is not None:
        return cycle_time_ms / 1000.0
    return 0.0 if usable_cpus() >= 2 * local_size else CROWDED_CYCLE_TIME_MS / 1000.0


def is_initialized() -> bool:
    """Whether this process has joined a job (``init`` ran and ``shutdown`` did not)."""
    return _runtime is not None


def runtime() -> Runtime:
    """The current runtime, or NotInitializedError."""
    rt = _runtime
    if rt is None:
        raise NotInitializedError()
    return rt


def topology() -> Topology:
    return runtime().topology


def _atexit() -> None:
    rt = _runtime
    in_flight = rt.engine.pending_count() if rt is not None and rt.engine else 0
    fatal = rt.engine.fatal if rt is not None and rt.engine else None
    if fatal is not None and getattr(fatal, "rank", -1) not in (-1, rt.topology.rank):
        # another rank's failure ended this one: say so, so the others keep blaming that
        # rank rather than this departure
        reason = SECONDARY_DEPARTURE + str(fatal)
    elif _uncaught:
        reason = "the process exited after an uncaught " + _uncaught
    elif in_flight:
        reason = (f"the process exited while {in_flight} collective call(s) were in flight, "
                  f"without calling ddl.shutdown()")
        # a record for the launcher: this rank may exit 0, and the others too (each with
        # calls in flight), and then no survivor's report would name it
        rank, where = rt.topology.rank, rt.config.report_dir
        if where and _report.read(where, rank) is None:   # a fatal error's comes first
            _report.write(where, rank, ShutdownError(
                f"rank {rank}: {reason}", rank=rank, pid=os.getpid(), cause=reason))
    else:
        reason = "the process exited without calling ddl.shutdown()"
    try:
        _shutdown(reason)
    except DDLError:
        pass


# Shut down before interpreter exit joins thread pools: concurrent.futures joins its
# workers (the embedded coordinator's gRPC handlers among them) in a threading exit hook
# that runs before ``atexit`` handlers, and those handlers wait for our goodbye. Hooks run
# last-registered first, and this one is registered after grpc imported concurrent.futures.
# Importing concurrent.futures.thread first puts its hook before ours.
import concurrent.futures.thread  # noqa: E402,F401  (registers its exit hook now)


def _forget_in_child() -> None:
    """A forked child (a data-loader worker, say) is not a rank of the job: it drops the
    parent's runtime, whose threads and streams did not come along, so that its exit does
    not try to say the parent's goodbye (and calls in it raise NotInitializedError)."""
    global _runtime, _state_lock
    _runtime = None
    _state_lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_atexit)
else:  # pragma: no cover - other Pythons
    atexit.register(_atexit)

__all__: Tuple[str, ...] = ("init", "shutdown", "is_initialized", "runtime", "topology",
                            "start_timeline", "stop_timeline")
