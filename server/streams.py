"""What every coordinator does for its local workers: serve gRPC, hold their streams.

:class:`StreamServer` is the part the leader (:class:`~ddl.server.coordinator.
CoordinatorServer`) and a non-leader coordinator (:class:`~ddl.server.relay.RelayServer`)
share: binding (unix socket 0600, or TCP), one ``Negotiate`` stream per worker with a
reader thread and an unbounded outgoing queue (so nothing blocks while a lock is held),
HTTP/2 keepalive on every connection (:mod:`ddl.core.keepalive`: a frozen worker's stream
breaks within seconds), heartbeats on idle streams, the hello deadline, and the
end-of-job bookkeeping behind :meth:`StreamServer.wait`. Subclasses decide what a
hello, a message and a closed stream mean (:meth:`_accept_hello`, :meth:`_handle`,
:meth:`_stream_closed`) and answer ``Register``, ``Ping`` and ``PeerLink``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent import futures
from typing import Dict, Iterable, Iterator, List, Optional, Set

import grpc

from ddl.core import keepalive as _keepalive
from ddl.core import limits as _limits
from ddl.core import report as _report
from ddl.core.config import default
from ddl.v1 import coordinator_pb2 as pb

from .auth import AuthInterceptor, unauthenticated_connection_options
from .validation import clip, make_error

log = logging.getLogger("ddl.server")

# defaults of the daemon's flags (the config table's): a stream idle this long gets a
# Heartbeat; a worker or peer silent this long is lost; seconds between HTTP/2 keepalive
# pings; a connection whose ping goes unanswered this long closes
HEARTBEAT_INTERVAL_S = default("heartbeat_interval")
LIVENESS_TIMEOUT_S = default("liveness_timeout")
KEEPALIVE_INTERVAL_S = default("keepalive_interval")
KEEPALIVE_TIMEOUT_S = default("keepalive_timeout")
EXIT_REPORT_WAIT_S = 0.5  # a lost worker: how long to wait for the launcher's exit record
GONE_WAIT_S = 0.2  # a lost worker that still looks alive: how long it may take to end
# a failed job waits this long at most for a registered rank to open its control stream
# (and be told), unless the rank is known to be gone
LATE_STREAM_WAIT_S = 5.0
HELLO_TIMEOUT_S = 10.0  # a stream must say hello within this
POLL_S = 0.1  # how often a response generator re-checks its stream
END = object()  # queue marker: the server ends this stream


class HelloRejected:
    """Queue item: end the stream with INVALID_ARGUMENT and this message."""

    def __init__(self, message: str):
        self.message = message


class Stream:
    """Server side of one worker's Negotiate stream (or, on the leader, of a worker
    relayed by a non-leader coordinator: then ``out`` feeds that coordinator's link)."""

    def __init__(self, out: Optional["queue.Queue[object]"] = None,
                 watch: bool = True) -> None:
        self.rank: Optional[int] = None
        self.out = out if out is not None else queue.Queue()
        self.watch = watch  # liveness applies (a relayed worker is watched by its node)
        self.last_seen = time.monotonic()
        self.goodbye = False  # the worker left cleanly
        self.ended_by_server = False  # an Abort (or stop) ended it
        self.closed = False


def drain(out: "queue.Queue[object]", context: grpc.ServicerContext,
          heartbeat, ready=lambda: True, on_idle=lambda now: None,
          interval: float = HEARTBEAT_INTERVAL_S) -> Iterator[object]:
    """Yield the items of ``out`` while the call is active; ``heartbeat()`` after
    ``interval`` seconds idle once ``ready()``; stop at :data:`END`.
    ``on_idle(now)`` runs on every idle poll (it may abort the call)."""
    last_sent = time.monotonic()
    while context.is_active():
        try:
            item = out.get(timeout=min(POLL_S, interval))
        except queue.Empty:
            now = time.monotonic()
            on_idle(now)
            if ready() and now - last_sent >= interval:
                last_sent = now
                yield heartbeat()
            continue
        if item is END:
            return
        last_sent = time.monotonic()
        yield item


class BadMessage(Exception):
    """A request that does not parse as the message its method takes."""


def _decode(raw: bytes, message_type):
    try:
        return message_type.FromString(raw)
    except Exception:  # DecodeError, or anything else a hostile payload provokes
        raise BadMessage(f"a request of {len(raw)} bytes is not a valid "
                         f"{message_type.DESCRIPTOR.full_name}") from None


def decoded(raw_iterator: Iterator[bytes], message_type) -> Iterator[object]:
    """The messages of a request stream; raises :class:`BadMessage` at one that does not
    parse."""
    for raw in raw_iterator:
        yield _decode(raw, message_type)


def _service(core: "StreamServer") -> grpc.GenericRpcHandler:
    """The Coordinator service with requests decoded by the handlers, not by gRPC: a
    request gRPC fails to deserialize leaks its call state (grpcio 1.85), while a
    handler that aborts with INVALID_ARGUMENT frees it."""

    def unary(method, request_type, response_type):
        def handle(raw: bytes, context: grpc.ServicerContext):
            try:
                request = _decode(raw, request_type)
            except BadMessage as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return method(request, context)
        return grpc.unary_unary_rpc_method_handler(
            handle, response_serializer=response_type.SerializeToString)

    def bidi(method, response_type):
        return grpc.stream_stream_rpc_method_handler(
            method, response_serializer=response_type.SerializeToString)

    return grpc.method_handlers_generic_handler("ddl.v1.Coordinator", {
        "Register": unary(core._register, pb.RegisterRequest, pb.RegisterResponse),
        "Ping": unary(lambda request, context: core._ping(), pb.PingRequest,
                      pb.PingResponse),
        "Negotiate": bidi(core._negotiate, pb.CoordinatorMessage),
        "PeerLink": bidi(core._peer_link, pb.LeaderMessage),
    })


class StreamServer:
    """Base of the coordinators: see the module doc. ``size`` is the job's size;
    ``expected`` the number of workers this coordinator serves itself."""

    role = "coordinator"

    def __init__(self, job_id: str, secret_hex: str, size: int, address: str,
                 expected: int, start_timeout: float,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                 liveness_timeout: float = LIVENESS_TIMEOUT_S, report_dir: str = "",
                 keepalive_interval: float = KEEPALIVE_INTERVAL_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S):
        if size < 1:
            raise ValueError(f"{type(self).__name__}: size must be >= 1, got {size}")
        self.job_id = job_id
        self.size = size
        self.address = address
        self.start_timeout = start_timeout
        self.expected = expected
        self.heartbeat_interval = heartbeat_interval
        self.liveness_timeout = liveness_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout  # 0: no keepalive pings
        self.report_dir = report_dir  # where the launcher records how workers exited
        self._auth = AuthInterceptor(secret_hex, job_id)  # validates the secret early
        self._lock = threading.Lock()
        self._streams: Dict[int, Stream] = {}
        self._left: Set[int] = set()
        # pids of workers lost while their process was stopped (frozen): the job is
        # not over for this coordinator until they are gone, so that one that is
        # continued finds it up and learns that it was lost (ControlClient._broken)
        self._frozen: Set[int] = set()
        self._failed = False
        self._failed_since: Optional[float] = None  # when a failed job could first end
        self._done = threading.Event()
        self._stop_event = threading.Event()
        self._stopped = False
        self._server: Optional[grpc.Server] = None
        self._monitor: Optional[threading.Thread] = None
        self._socket_path: Optional[str] = None
        self._extra_ports: List[str] = []
        self.bound_address: Optional[str] = None
        self.extra_bound: List[str] = []  # addresses added by listen_also, once bound
        checks = [start_timeout / 4] + ([liveness_timeout / 4] if liveness_timeout > 0 else [])
        self._tick_s = max(0.01, min([1.0] + checks))

    # -- lifecycle ---------------------------------------------------------------------
    def listen_also(self, address: str) -> None:
        """Serve on ``address`` (``host:port``) too; call before :meth:`start`."""
        self._extra_ports.append(address)

    def start(self) -> str:
        """Bind and start serving; returns the bound address. See :attr:`extra_bound`."""
        if self._server is not None:
            raise RuntimeError(f"{type(self).__name__}.start() was already called")
        _limits.raise_open_files_limit()  # a flood of connections costs descriptors
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * self.size + 16,
                                                        thread_name_prefix="ddl-coord"),
                             interceptors=[self._auth],
                             options=[("grpc.so_reuseport", 0)]
                             + unauthenticated_connection_options()
                             + _keepalive.server_options(self.keepalive_interval,
                                                         self.keepalive_timeout))
        server.add_generic_rpc_handlers((_service(self),))
        if self.address.startswith("unix:"):
            path = self.address[len("unix:"):]
            path = "/" + path.lstrip("/") if path.startswith("//") else path
            if not os.path.isabs(path):
                raise ValueError(f"coordinator address {self.address!r}: a unix socket path "
                                 f"must be absolute")
            server.add_insecure_port(f"unix:{path}")
            self._socket_path = path
            bound = f"unix:{path}"
        else:
            bound = self._bind_tcp(server, self.address)
        self.extra_bound = [self._bind_tcp(server, a) for a in self._extra_ports]
        self._before_serving()
        server.start()
        if self._socket_path is not None:
            os.chmod(self._socket_path, 0o600)
        self._server = server
        self.bound_address = bound
        self._monitor = threading.Thread(target=self._monitor_loop, name="ddl-coord-monitor",
                                         daemon=True)
        self._monitor.start()
        log.info("%s serving job %s (size %d) on %s", self.role, self.job_id, self.size,
                 ", ".join([bound] + self.extra_bound))
        return bound

    @staticmethod
    def _bind_tcp(server: grpc.Server, address: str) -> str:
        port = server.add_insecure_port(address)
        if not port:
            raise RuntimeError(f"coordinator could not bind {address!r}")
        return f"{address.rsplit(':', 1)[0]}:{port}"

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once the job is over for this coordinator, or the server stopped."""
        return self._done.wait(timeout)

    @property
    def failed(self) -> bool:
        """The job ended badly: a lost worker or coordinator, a stall, a start timeout."""
        return self._failed

    def failure(self) -> str:
        """The first line of the job's fatal error ("" when none is known here)."""
        with self._lock:
            err = self._fatal_error()
        return err.message.splitlines()[0] if err is not None and err.message else ""

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (idempotent); removes the unix socket file."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for s in self._streams.values():
                s.ended_by_server = True
                s.out.put(END)
        self._stop_event.set()
        self._on_stop()
        if self._server is not None:
            try:
                self._server.stop(grace).wait(grace + 1.0)
            except RuntimeError:
                # gRPC waits out a grace in a new thread, and from Python 3.12 on no thread
                # starts once the interpreter is finishing (a process that exits without
                # ddl.shutdown() gets here from its exit hook): cancel the calls at once
                self._server.stop(None)
        if self._monitor is not None:
            self._monitor.join(timeout=2.0)
        if self._socket_path is not None:
            try:
                os.unlink(self._socket_path)
            except FileNotFoundError:
                pass
        self._done.set()

    # -- hooks -------------------------------------------------------------------------
    def _before_serving(self) -> None:
        """Runs after binding, before the first call is served."""

    def _on_stop(self) -> None:
        """Runs once in :meth:`stop`, before the server stops."""

    def _tick(self) -> bool:
        """Periodic checks (call without the lock); True ends the monitor."""
        return False

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                  ) -> pb.RegisterResponse:
        raise NotImplementedError

    def _ping(self) -> pb.PingResponse:
        raise NotImplementedError

    def _peer_link(self, request_iterator, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"peer link: this {self.role} is not the leader of job {self.job_id}")

    def _accept_hello(self, stream: Stream, msg: pb.WorkerMessage) -> Optional[str]:
        """Bind ``stream`` to the hello's rank; the refusal text, or None."""
        raise NotImplementedError

    def _handle(self, stream: Stream, msg: pb.WorkerMessage) -> bool:
        """Process one message after hello; False once the stream is finished."""
        raise NotImplementedError

    def _stream_closed(self, stream: Stream, cause: str = "") -> None:
        """The stream ended: a goodbye, a server-side end, or a lost worker (``cause``:
        why, when known)."""
        raise NotImplementedError

    # -- shared helpers ----------------------------------------------------------------
    def _hello_problem(self, msg: pb.WorkerMessage) -> Optional[str]:
        """Why a first message is not an acceptable hello, or None (checks job id only)."""
        kind = msg.WhichOneof("kind")
        if kind != "hello":
            return f"negotiate: the first message must be hello, got {kind or 'nothing'}"
        if msg.hello.job_id != self.job_id:
            return (f"negotiate: hello from rank {msg.hello.rank} names job "
                    f"{clip(msg.hello.job_id)!r}, but this coordinator serves job "
                    f"{self.job_id!r}")
        return None

    def _bind_stream(self, stream: Stream, rank: int,
                     fatal: Optional[pb.Error]) -> Optional[str]:
        """Under the lock: make ``stream`` rank's stream; abort it at once if ``fatal``."""
        if rank in self._streams:
            return (f"negotiate: rank {rank} already has a control stream (or had one and "
                    f"left)")
        stream.rank = rank
        self._streams[rank] = stream
        if fatal is not None or self._stopped:
            fatal = fatal or _shutdown_error()
            stream.out.put(pb.CoordinatorMessage(abort=fatal))
            stream.ended_by_server = True
            stream.out.put(END)
        return None

    def _end_stream(self, stream: Stream, msg: Optional[pb.CoordinatorMessage]) -> None:
        """Under the lock: send ``msg`` (if any) then end ``stream``."""
        if stream.closed or stream.ended_by_server:
            return
        if msg is not None:
            stream.out.put(msg)
        stream.ended_by_server = True
        stream.out.put(END)

    def _check_done(self) -> None:
        """Under the lock: every expected worker left, or a failed job has no stream; and
        no worker lost while stopped lives on."""
        all_left = len(self._left) >= self.expected
        no_stream_open = not any(not s.closed for s in self._streams.values())
        self._frozen = {pid for pid in self._frozen
                        if _report.process_state(pid) not in ("", "Z", "X")}
        if self._frozen:
            return
        if all_left or (self._failed and no_stream_open and self._registration_over()):
            self._done.set()

    def _registration_over(self) -> bool:
        return True

    def _every_rank_told(self, ranks: Iterable[int]) -> bool:
        """Under the lock, once the job failed: every rank of ``ranks`` opened its control
        stream (so it was told why), left, or ended (the launcher's exit record); or
        :data:`LATE_STREAM_WAIT_S` passed since this was first asked."""
        if self._failed_since is None:
            self._failed_since = time.monotonic()
        if time.monotonic() - self._failed_since >= LATE_STREAM_WAIT_S:
            return True
        return all(r in self._streams or r in self._left or self._exit_record(r, wait=0)
                   for r in ranks)

    def _exit_record(self, rank: int, wait: float = EXIT_REPORT_WAIT_S) -> str:
        """How the launcher saw ``rank``'s process end ("its process was killed by ..."),
        waiting up to ``wait`` s for the record; "" without one."""
        if not self.report_dir:
            return ""
        deadline = time.monotonic() + wait
        while True:
            how = _report.read_exit(self.report_dir, rank)
            if how or time.monotonic() >= deadline:
                return f"its process {how}" if how else ""
            time.sleep(0.01)

    def _close_bound(self, stream: Stream) -> Optional[int]:
        """Under the lock: mark ``stream`` closed; its rank if this closes the stream
        bound to that rank (which has then left), else None."""
        if stream.closed:
            return None
        stream.closed = True
        rank = stream.rank
        if rank is None or self._streams.get(rank) is not stream:
            return None
        self._left.add(rank)
        return rank

    @staticmethod
    def _is_lost(stream: Stream) -> bool:
        """Closing without a goodbye and not ended by us: the worker was lost."""
        return not stream.closed and not stream.goodbye and not stream.ended_by_server

    def _worker_pid(self, rank: int) -> int:
        """The pid ``rank`` registered with (a worker of this host), or 0."""
        return 0

    def _lost_cause(self, stream: Stream) -> str:
        """Why a worker's stream closed without a goodbye: how the launcher saw its
        process end (waiting up to :data:`EXIT_REPORT_WAIT_S` for that record); that it
        is stopped, or still runs but its connection failed the keepalive (frozen or
        unreachable); else that the stream closed. Call without the lock."""
        pid = self._worker_pid(stream.rank) if stream.rank is not None else 0
        if stream.rank is not None and self.report_dir:
            deadline = time.monotonic() + EXIT_REPORT_WAIT_S
            while True:
                how = _report.read_exit(self.report_dir, stream.rank)
                if how:
                    return f"its process {how}"
                if time.monotonic() >= deadline or _report.is_stopped(pid):
                    break
                time.sleep(0.01)
        if _report.is_stopped(pid):
            with self._lock:
                self._frozen.add(pid)
            stopped = "its process is stopped (SIGSTOP or a debugger)"
            if self.keepalive_timeout > 0:
                return f"{stopped}: {_keepalive.cause(self.keepalive_timeout)}"
            return stopped
        # a killed process closes its sockets on its way out, before it is a zombie:
        # one on its way out counts as ended (X), and one that still looks alive gets a
        # moment to end before its lost connection is put down to keepalive
        state = _report.process_state(pid, count_exiting=True)
        settle = time.monotonic() + GONE_WAIT_S
        while state and state not in "ZX" and time.monotonic() < settle:
            time.sleep(0.01)
            state = _report.process_state(pid, count_exiting=True)
        if state and state not in "ZX" and self.keepalive_timeout > 0:
            return _keepalive.cause(self.keepalive_timeout)
        if pid and state in ("", "Z", "X"):   # a worker of this host, gone
            return "its process ended without a goodbye (killed, or it crashed)"
        return "its control stream closed without a goodbye"

    # -- monitor -----------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self._stop_event.wait(self._tick_s):
            if self._tick():
                return
            if self._frozen:
                with self._lock:
                    self._check_done()
            self._check_liveness()

    def _check_liveness(self) -> None:
        """A bound worker stream silent past the liveness timeout is lost (a frozen or
        unreachable worker); its stream then ends with the job's error, which it reads if
        it ever wakes up."""
        if self.liveness_timeout <= 0:
            return
        now = time.monotonic()
        with self._lock:
            silent = [s for s in self._streams.values()
                      if s.watch and not s.closed and not s.ended_by_server
                      and now - s.last_seen > self.liveness_timeout]
        for stream in silent:
            cause = (f"it sent nothing for {now - stream.last_seen:.1f} s (liveness timeout "
                     f"{self.liveness_timeout:g} s): "
                     f"{_keepalive.silence(self.keepalive_interval, self.keepalive_timeout, self.liveness_timeout)}")
            self._stream_closed(stream, cause)
            with self._lock:
                fatal = self._fatal_error() or make_error(pb.PEER_LOST, cause)
                stream.out.put(pb.CoordinatorMessage(abort=fatal))
                stream.ended_by_server = True
                stream.out.put(END)

    def _fatal_error(self) -> Optional[pb.Error]:
        """The job's fatal error, if any (under the lock)."""
        return None

    # -- Negotiate ---------------------------------------------------------------------
    def _negotiate(self, request_iterator: Iterator[pb.WorkerMessage],
                   context: grpc.ServicerContext) -> Iterator[pb.CoordinatorMessage]:
        stream = Stream()
        context.add_callback(lambda: self._stream_closed(stream))
        reader = threading.Thread(target=self._read_loop, args=(request_iterator, stream),
                                  name="ddl-coord-reader", daemon=True)
        reader.start()
        hello_deadline = time.monotonic() + HELLO_TIMEOUT_S

        def on_idle(now: float) -> None:
            if stream.rank is None and now >= hello_deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"negotiate: no hello within {HELLO_TIMEOUT_S:g} s")

        for item in drain(stream.out, context, _heartbeat, lambda: stream.rank is not None,
                          on_idle, self.heartbeat_interval):
            if isinstance(item, HelloRejected):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
            yield item  # type: ignore[misc]

    def _read_loop(self, request_iterator: Iterator[bytes], stream: Stream) -> None:
        try:
            for msg in decoded(request_iterator, pb.WorkerMessage):
                stream.last_seen = time.monotonic()
                if stream.rank is None:
                    refusal = self._accept_hello(stream, msg)  # type: ignore[arg-type]
                    if refusal is not None:
                        log.warning("%s", refusal)
                        stream.out.put(HelloRejected(refusal))
                        return
                    continue
                if not self._handle(stream, msg):  # type: ignore[arg-type]
                    return
            if stream.rank is None:
                stream.out.put(HelloRejected("negotiate: the stream ended before hello"))
        except BadMessage as exc:
            log.warning("negotiate: rank %s: %s", "?" if stream.rank is None else stream.rank,
                        exc)
            stream.out.put(HelloRejected(f"negotiate: {exc}"))
        except Exception:  # the stream broke (cancelled, connection lost, server stopping)
            pass
        finally:
            self._stream_closed(stream)


def _heartbeat() -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))


def _shutdown_error() -> pb.Error:
    return make_error(pb.SHUTDOWN, "the coordinator stopped")
