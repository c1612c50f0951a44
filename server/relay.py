"""A non-leader coordinator: :class:`RelayServer`.

It serves its node's workers exactly as the leader does (same RPCs, same socket rules)
and relays them to the leader over TCP: ``Register`` calls one by one (each with the
worker's own deadline), and every worker's ``Negotiate`` messages over a single
``PeerLink`` stream, tagged with the rank. The leader's messages come back on that
stream and fan out to the ranks they name.

Failures: a local worker whose stream closes without a goodbye is reported to the
leader (``RankClosed``), which aborts the job naming that rank. If the leader goes away,
answers no keepalive ping within ``keepalive_timeout`` seconds (frozen or unreachable),
or sends nothing for ``liveness_timeout`` seconds, every local worker gets an Abort of
kind COORDINATOR_LOST naming the leader, and this coordinator ends with ``failed``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Dict, Iterator, Optional, Set

import grpc

from ddl.core import auth as _auth
from ddl.core import keepalive as _keepalive
from ddl.core.config import default
from ddl.v1 import coordinator_pb2 as pb
from ddl.v1 import coordinator_pb2_grpc as pb_grpc

from .streams import (END, HEARTBEAT_INTERVAL_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_TIMEOUT_S,
                      LIVENESS_TIMEOUT_S, Stream, StreamServer)
from .validation import make_error, peer_lost_error

log = logging.getLogger("ddl.server")

STOP_DRAIN_S = 2.0  # at stop, how long the link may take to deliver what is queued


class RelayServer(StreamServer):
    """The coordinator of a node other than node 0, serving ``local_size`` workers.

    ``leader_address`` is the leader's ``host:port`` for peer coordinators. :meth:`start`
    connects to it (within ``start_timeout``) before serving; it raises RuntimeError if
    the leader cannot be reached.
    """

    role = "coordinator"

    def __init__(self, job_id: str, secret_hex: str, size: int, address: str,
                 leader_address: str, local_size: int, hostname: str,
                 start_timeout: float = default("start_timeout"),
                 heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                 liveness_timeout: float = LIVENESS_TIMEOUT_S, report_dir: str = "",
                 keepalive_interval: float = KEEPALIVE_INTERVAL_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S):
        if not 1 <= local_size <= size:
            raise ValueError(f"RelayServer: local_size must be in [1, {size}], got "
                             f"{local_size}")
        super().__init__(job_id, secret_hex, size, address, local_size, start_timeout,
                         heartbeat_interval, liveness_timeout, report_dir,
                         keepalive_interval, keepalive_timeout)
        self.leader_address = leader_address
        self.hostname = hostname
        self._metadata = ((_auth.GRPC_METADATA_KEY, _auth.grpc_token(secret_hex, job_id)),)
        self._channel: Optional[grpc.Channel] = None
        self._stub: Optional[pb_grpc.CoordinatorStub] = None
        self._up: "queue.Queue[object]" = queue.Queue()
        self._registered: Dict[int, pb.RegisterRequest] = {}
        self._told_at_register: Set[int] = set()  # answered with the rendezvous' error
        self._fatal: Optional[pb.Error] = None
        self._last_seen = time.monotonic()
        self._link_call = None
        self._down_thread: Optional[threading.Thread] = None

    # -- lifecycle ---------------------------------------------------------------------
    def _before_serving(self) -> None:
        options = [("grpc.enable_http_proxy", 0),
                   ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
        options += _keepalive.channel_options(self.keepalive_interval, self.keepalive_timeout)
        self._channel = grpc.insecure_channel(self.leader_address, options=options)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.start_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise RuntimeError(f"could not reach the leader coordinator at "
                               f"{self.leader_address} within {self.start_timeout:g} s") \
                from None
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._up.put(pb.PeerMessage(hello=pb.PeerHello(job_id=self.job_id,
                                                        hostname=self.hostname,
                                                        pid=os.getpid())))
        self._link_call = self._stub.PeerLink(self._uplink(), metadata=self._metadata)
        self._last_seen = time.monotonic()
        self._down_thread = threading.Thread(target=self._downlink, name="ddl-relay-down",
                                             daemon=True)
        self._down_thread.start()

    def abort_job(self, kind: int, message: str, cause: str = "", host: str = "") -> None:
        """Abort every local worker with an error of ``kind``; the leader then loses
        this node's ranks (its link ends). With a ``cause``, the error names this
        coordinator (``host``, its pid) as the origin."""
        err = make_error(kind, message)
        if cause:
            err.cause, err.origin_host, err.origin_pid = cause, host, os.getpid()
        self._leader_lost(err)

    def _on_stop(self) -> None:
        self._up.put(END)
        if self._down_thread is not None:  # let the last goodbyes reach the leader
            self._down_thread.join(STOP_DRAIN_S)
        if self._link_call is not None:
            self._link_call.cancel()
        if self._channel is not None:
            self._channel.close()

    def _ping(self) -> pb.PingResponse:
        with self._lock:
            registered = len(self._registered)
        return pb.PingResponse(job_id=self.job_id, registered=registered, size=self.size,
                               leader=False, pid=os.getpid())

    def _registration_over(self) -> bool:
        """A failed job ends once every rank registered here was told (or is gone)."""
        return self._every_rank_told([r for r in self._registered
                                      if r not in self._told_at_register])

    # -- the link to the leader ----------------------------------------------------------
    def _uplink(self) -> Iterator[pb.PeerMessage]:
        while True:
            try:
                item = self._up.get(timeout=self.heartbeat_interval)
            except queue.Empty:
                yield pb.PeerMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))
                continue
            if item is END:
                return
            yield item  # type: ignore[misc]

    def _send_up(self, rank: int, msg: pb.WorkerMessage) -> None:
        self._up.put(pb.PeerMessage(worker=pb.RankMessage(rank=rank, message=msg)))

    def _downlink(self) -> None:
        why = "it closed the peer link"
        try:
            for msg in self._link_call:  # type: ignore[union-attr]
                self._last_seen = time.monotonic()
                kind = msg.WhichOneof("kind")
                if kind == "workers":
                    self._deliver(msg.workers)
                elif kind == "abort":
                    self._leader_lost(msg.abort)
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"  # type: ignore[union-attr]
            if self.keepalive_timeout > 0 and _keepalive.is_keepalive_failure(
                    exc.details()):  # type: ignore[union-attr]
                why = f"{_keepalive.cause(self.keepalive_timeout)} ({why})"
        except Exception as exc:  # pragma: no cover - a bug must still end the job
            why = f"{type(exc).__name__}: {exc}"
        if not self._stopped and not self._done.is_set():
            self._leader_lost(None, why)

    def _deliver(self, rm: pb.RanksMessage) -> None:
        with self._lock:
            for rank in rm.ranks:
                stream = self._streams.get(rank)
                if stream is None or stream.closed or stream.ended_by_server:
                    continue
                if rm.message.HasField("abort"):
                    if self._fatal is None and rm.message.abort.kind not in (
                            pb.MISMATCH, pb.INVALID):
                        self._fatal = rm.message.abort
                        self._failed = True
                    self._end_stream(stream, rm.message)
                else:
                    stream.out.put(rm.message)
            self._check_done()

    def _leader_lost(self, err: Optional[pb.Error], why: str = "") -> None:
        """Abort every local worker with ``err``, or a COORDINATOR_LOST naming the leader,
        and end the link."""
        if err is None:
            err = make_error(pb.COORDINATOR_LOST,
                             f"the leader coordinator at {self.leader_address} was lost: {why}")
            err.cause = why
            if self._fatal is None:
                log.error("%s", err.message)
        self._abort_local(err)
        self._up.put(END)

    def _abort_local(self, err: pb.Error) -> None:
        """Make ``err`` this node's fatal error (the first one stays) and abort every
        local worker with it."""
        with self._lock:
            if self._fatal is None:
                self._fatal = err
            self._failed = True
            for stream in self._streams.values():
                self._end_stream(stream, pb.CoordinatorMessage(abort=self._fatal))
            self._check_done()

    def _tick(self) -> bool:
        if self._fatal is None and self.liveness_timeout > 0:
            silent = time.monotonic() - self._last_seen
            if silent > self.liveness_timeout:
                self._leader_lost(None, f"no message for {silent:.1f} s (liveness timeout "
                                        f"{self.liveness_timeout:g} s)")
                if self._link_call is not None:
                    self._link_call.cancel()
        return False

    # -- Register ----------------------------------------------------------------------
    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                  ) -> pb.RegisterResponse:
        remaining = context.time_remaining()
        timeout = self.start_timeout if remaining is None else min(remaining,
                                                                   self.start_timeout + 5)
        try:
            resp = self._stub.Register(request, timeout=timeout,  # type: ignore[union-attr]
                                       metadata=self._metadata)
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())  # type: ignore[attr-defined]
        with self._lock:
            self._registered[request.rank] = request
            if resp.HasField("error"):  # told at once: it opens no stream
                self._told_at_register.add(request.rank)
        return resp

    # -- worker streams ----------------------------------------------------------------
    def _accept_hello(self, stream: Stream, msg: pb.WorkerMessage) -> Optional[str]:
        problem = self._hello_problem(msg)
        if problem is not None:
            return problem
        rank = msg.hello.rank
        with self._lock:
            if rank not in self._registered:
                return (f"negotiate: hello from rank {rank}, which has not registered "
                        f"through this coordinator")
            refusal = self._bind_stream(stream, rank, self._fatal)
            if refusal is None and self._fatal is None:
                self._send_up(rank, msg)
            return refusal

    def _handle(self, stream: Stream, msg: pb.WorkerMessage) -> bool:
        rank = stream.rank
        assert rank is not None
        kind = msg.WhichOneof("kind")
        if kind == "requests":
            self._send_up(rank, msg)
        elif kind == "goodbye":
            log.info("rank %d said goodbye (%s)", rank, msg.goodbye.reason or "no reason")
            with self._lock:
                stream.goodbye = True
                self._send_up(rank, msg)
                stream.out.put(END)
            return False
        elif kind == "hello":
            log.warning("negotiate: rank %d sent a second hello; ignored", rank)
        return True

    def _fatal_error(self) -> Optional[pb.Error]:
        return self._fatal

    def _worker_pid(self, rank: int) -> int:
        with self._lock:
            reg = self._registered.get(rank)
        return reg.pid if reg is not None else 0

    def _stream_closed(self, stream: Stream, cause: str = "") -> None:
        if not cause and self._is_lost(stream):
            cause = self._lost_cause(stream)
        with self._lock:
            lost = self._is_lost(stream)
            rank = self._close_bound(stream)
            if rank is None:
                return
            if lost:
                cause = cause or "its control stream closed without a goodbye"
                self._up.put(pb.PeerMessage(closed=pb.RankClosed(rank=rank, cause=cause)))
            self._check_done()
        if lost:
            # This node knows first: its other workers need not wait for the leader's
            # abort (which carries the same error).
            reg = self._registered[rank]
            err = peer_lost_error(rank, reg.hostname, reg.pid, cause)
            log.error("%s", err.message)
            self._abort_local(err)
        if self._done.is_set():
            self._up.put(END)
