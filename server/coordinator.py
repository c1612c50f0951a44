"""The coordinator's gRPC face: the servicer, its streams, and :class:`CoordinatorServer`.

One :class:`CoordinatorServer` serves one job. ``Register`` runs the rendezvous;
``Negotiate`` holds one bidirectional stream per worker. A reader thread per stream
feeds the worker's messages to the :class:`~ddl.server.leader.Leader` under one lock;
the leader's answers go onto per-stream queues (unbounded, so nothing blocks while the
lock is held), and the stream's response generator drains its queue with timeouts,
sending a heartbeat after one idle second.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent import futures
from typing import Dict, Iterator, List, Optional, Set

import grpc

from ddl.v1 import coordinator_pb2 as pb
from ddl.v1 import coordinator_pb2_grpc as pb_grpc

from .auth import AuthInterceptor
from .leader import Delivery, Leader
from .rendezvous import RegisterError, Rendezvous
from .validation import make_error

log = logging.getLogger("ddl.server")

HEARTBEAT_INTERVAL_S = 1.0  # a stream idle this long gets a Heartbeat
HELLO_TIMEOUT_S = 10.0  # a stream must say hello within this
_POLL_S = 0.1  # how often a response generator re-checks its stream
_END = object()  # queue marker: the server ends this stream


class _HelloRejected:
    def __init__(self, message: str):
        self.message = message


class _Stream:
    """Server side of one worker's Negotiate stream."""

    def __init__(self) -> None:
        self.rank: Optional[int] = None
        self.out: "queue.Queue[object]" = queue.Queue()
        self.goodbye = False  # the worker left cleanly
        self.ended_by_server = False  # an Abort (or stop) ended it
        self.closed = False


class _Servicer(pb_grpc.CoordinatorServicer):
    def __init__(self, core: "CoordinatorServer"):
        self._core = core

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                 ) -> pb.RegisterResponse:
        return self._core._register(request, context)

    def Negotiate(self, request_iterator: Iterator[pb.WorkerMessage],
                  context: grpc.ServicerContext) -> Iterator[pb.CoordinatorMessage]:
        return self._core._negotiate(request_iterator, context)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        core = self._core
        return pb.PingResponse(job_id=core.job_id, registered=core._rdv.registered(),
                               size=core.size, leader=True, pid=os.getpid())


class CoordinatorServer:
    """The leader coordinator of one job, served over gRPC.

    ``address`` is ``unix:/abs/path.sock`` or ``host:port`` (port 0 picks a free one).
    The job is over (:meth:`wait` returns True) once every rank registered and then left,
    by goodbye or by being lost, once a failed job has no open stream left, or once the
    server was stopped. :attr:`failed` tells whether it ended badly.
    """

    def __init__(self, job_id: str, secret_hex: str, size: int, address: str,
                 fusion_threshold: int = 64 << 20, stall_check_time: float = 60.0,
                 stall_shutdown_time: float = 600.0, start_timeout: float = 30.0):
        if size < 1:
            raise ValueError(f"CoordinatorServer: size must be >= 1, got {size}")
        self.job_id = job_id
        self.size = size
        self.address = address
        self.start_timeout = start_timeout
        self._auth = AuthInterceptor(secret_hex, job_id)  # validates the secret early
        self._leader = Leader(size, fusion_threshold, stall_check_time, stall_shutdown_time)
        self._rdv = Rendezvous(job_id, size, start_timeout, max(0, int(fusion_threshold)))
        self._lock = threading.Lock()
        self._streams: Dict[int, _Stream] = {}
        self._left: Set[int] = set()
        self._failed = False
        self._done = threading.Event()
        self._stop_event = threading.Event()
        self._stopped = False
        self._server: Optional[grpc.Server] = None
        self._monitor: Optional[threading.Thread] = None
        self._socket_path: Optional[str] = None
        self.bound_address: Optional[str] = None
        checks = [t / 4 for t in (stall_check_time, stall_shutdown_time) if t > 0]
        self._tick_s = max(0.01, min([1.0, start_timeout / 4] + checks))

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> str:
        """Bind and start serving; returns the bound address."""
        if self._server is not None:
            raise RuntimeError("CoordinatorServer.start() was already called")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * self.size + 16,
                                                        thread_name_prefix="ddl-coord"),
                             interceptors=[self._auth],
                             options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_CoordinatorServicer_to_server(_Servicer(self), server)
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
            port = server.add_insecure_port(self.address)
            if not port:
                raise RuntimeError(f"coordinator could not bind {self.address!r}")
            host = self.address.rsplit(":", 1)[0]
            bound = f"{host}:{port}"
        server.start()
        if self._socket_path is not None:
            os.chmod(self._socket_path, 0o600)
        self._server = server
        self.bound_address = bound
        self._monitor = threading.Thread(target=self._monitor_loop, name="ddl-coord-monitor",
                                         daemon=True)
        self._monitor.start()
        log.info("serving job %s (size %d) on %s", self.job_id, self.size, bound)
        return bound

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once the job is over (see the class doc) or the server stopped."""
        return self._done.wait(timeout)

    @property
    def failed(self) -> bool:
        """A worker was lost without goodbye, or a stall / start timeout aborted the job."""
        return self._failed

    def abort_job(self, kind: int, message: str) -> None:
        """Send an Abort of ``kind`` to every worker and end their streams."""
        with self._lock:
            self._failed = True
            self._dispatch(self._leader.abort(make_error(kind, message)))

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (idempotent); removes the unix socket file."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for s in self._streams.values():
                s.ended_by_server = True
                s.out.put(_END)
        self._stop_event.set()
        self._rdv.close()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
        if self._monitor is not None:
            self._monitor.join(timeout=2.0)
        if self._socket_path is not None:
            try:
                os.unlink(self._socket_path)
            except FileNotFoundError:
                pass
        self._done.set()

    # -- helpers (call with self._lock held) -------------------------------------------
    def _dispatch(self, deliveries: List[Delivery]) -> None:
        """Queue the leader's messages; an Abort ends the stream after it."""
        for rank, msg in deliveries:
            s = self._streams.get(rank)
            if s is None or s.closed or s.ended_by_server:
                continue
            s.out.put(msg)
            if msg.HasField("abort"):
                s.ended_by_server = True
                s.out.put(_END)
        if self._leader.fatal is not None:
            self._failed = True
        self._check_done()

    def _check_done(self) -> None:
        all_left = len(self._left) == self.size
        no_stream_open = not any(not s.closed for s in self._streams.values())
        if all_left or (self._failed and no_stream_open and self._rdv.complete()):
            self._done.set()

    # -- monitor -----------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self._stop_event.wait(self._tick_s):
            if self._rdv.timed_out():
                log.error("no complete rendezvous within %g s: missing ranks %s",
                          self.start_timeout, self._rdv.missing())
                with self._lock:
                    self._failed = True
                    self._dispatch(self._leader.abort(make_error(
                        pb.SHUTDOWN, f"rendezvous timed out after {self.start_timeout:g} s; "
                                     f"missing ranks {self._rdv.missing()}")))
                self._done.set()
                return
            with self._lock:
                self._dispatch(self._leader.inspect_stalls())

    # -- Register ----------------------------------------------------------------------
    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                  ) -> pb.RegisterResponse:
        remaining = context.time_remaining()
        caller_deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            resp = self._rdv.register(request, context.is_active, caller_deadline)
        except RegisterError as exc:
            log.warning("%s", exc.message)
            context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        with self._lock:
            for p in resp.peers:
                self._leader.set_peer(p.rank, p.hostname, p.pid)
        return resp

    # -- Negotiate ---------------------------------------------------------------------
    def _negotiate(self, request_iterator: Iterator[pb.WorkerMessage],
                   context: grpc.ServicerContext) -> Iterator[pb.CoordinatorMessage]:
        stream = _Stream()
        context.add_callback(lambda: self._stream_closed(stream))
        reader = threading.Thread(target=self._read_loop, args=(request_iterator, stream),
                                  name="ddl-coord-reader", daemon=True)
        reader.start()
        hello_deadline = time.monotonic() + HELLO_TIMEOUT_S
        last_sent = time.monotonic()
        while context.is_active():
            try:
                item = stream.out.get(timeout=_POLL_S)
            except queue.Empty:
                now = time.monotonic()
                if stream.rank is None and now >= hello_deadline:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"negotiate: no hello within {HELLO_TIMEOUT_S:g} s")
                if stream.rank is not None and now - last_sent >= HEARTBEAT_INTERVAL_S:
                    last_sent = now
                    yield pb.CoordinatorMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))
                continue
            if item is _END:
                return
            if isinstance(item, _HelloRejected):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
            last_sent = time.monotonic()
            yield item  # type: ignore[misc]

    def _accept_hello(self, stream: _Stream, msg: pb.WorkerMessage) -> Optional[str]:
        """Bind ``stream`` to the hello's rank; the refusal text, or None."""
        kind = msg.WhichOneof("kind")
        if kind != "hello":
            return f"negotiate: the first message must be hello, got {kind or 'nothing'}"
        hello = msg.hello
        if hello.job_id != self.job_id:
            return (f"negotiate: hello from rank {hello.rank} names job {hello.job_id!r}, but "
                    f"this coordinator serves job {self.job_id!r}")
        if not self._rdv.is_registered(hello.rank):
            return f"negotiate: hello from rank {hello.rank}, which has not registered"
        with self._lock:
            if hello.rank in self._streams:
                return (f"negotiate: rank {hello.rank} already has a control stream (or had "
                        f"one and left)")
            stream.rank = hello.rank
            self._streams[hello.rank] = stream
            if self._leader.fatal is not None or self._stopped:
                fatal = self._leader.fatal or make_error(pb.SHUTDOWN, "the coordinator stopped")
                stream.out.put(pb.CoordinatorMessage(abort=fatal))
                stream.ended_by_server = True
                stream.out.put(_END)
        return None

    def _read_loop(self, request_iterator: Iterator[pb.WorkerMessage],
                   stream: _Stream) -> None:
        try:
            for msg in request_iterator:
                if stream.rank is None:
                    refusal = self._accept_hello(stream, msg)
                    if refusal is not None:
                        log.warning("%s", refusal)
                        stream.out.put(_HelloRejected(refusal))
                        return
                    continue
                if not self._handle(stream, msg):
                    return
        except Exception:  # the stream broke (cancelled, connection lost, server stopping)
            pass
        finally:
            self._stream_closed(stream)

    def _handle(self, stream: _Stream, msg: pb.WorkerMessage) -> bool:
        """Process one message after hello; False once the stream is finished."""
        rank = stream.rank
        assert rank is not None
        kind = msg.WhichOneof("kind")
        if kind == "requests":
            with self._lock:
                self._dispatch(self._leader.submit(rank, msg.requests.requests))
        elif kind == "goodbye":
            log.info("rank %d said goodbye (%s)", rank, msg.goodbye.reason or "no reason")
            with self._lock:
                stream.goodbye = True
                self._dispatch(self._leader.goodbye(rank))
                stream.out.put(_END)
            return False
        elif kind == "hello":
            log.warning("negotiate: rank %d sent a second hello; ignored", rank)
        return True

    def _stream_closed(self, stream: _Stream) -> None:
        """The stream ended: a goodbye, a server-side end, or a lost worker."""
        with self._lock:
            if stream.closed:
                return
            stream.closed = True
            rank = stream.rank
            if rank is None or self._streams.get(rank) is not stream:
                return
            self._left.add(rank)
            if not stream.goodbye and not stream.ended_by_server:
                peer = self._leader.peer(rank)
                log.error("rank %d (host %s, pid %d) was lost: its control stream closed "
                          "without a goodbye", rank, peer.host, peer.pid)
                self._failed = True
                self._dispatch(self._leader.lost(
                    rank, "its control stream closed without a goodbye"))
            self._check_done()
