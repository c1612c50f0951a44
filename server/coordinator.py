"""The leader coordinator: :class:`CoordinatorServer`.

It serves its own node's workers (``Register``, ``Negotiate``; see
:mod:`ddl.server.streams`) and the other nodes' coordinators (``PeerLink``). Every
worker's messages, direct or relayed, reach the :class:`~ddl.server.leader.Leader` under
one lock; the leader's answers go onto per-stream queues. A relayed worker's queue feeds
its node's link, tagged with the rank (:class:`_LinkQueue`), so the leader logic cannot
tell a relayed worker from a local one.

A link that breaks (the peer died, or answered no keepalive ping within
``keepalive_timeout`` seconds: frozen or unreachable), or sends nothing for
``liveness_timeout`` seconds, makes every rank
relayed over it lost, and the job fails with COORDINATOR_LOST naming that node.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Dict, Iterator, List, Optional, Set

import grpc

from ddl.core import keepalive as _keepalive
from ddl.core import report as _report
from ddl.core.config import default
from ddl.core.fusion import DEFAULT_THRESHOLD
from ddl.v1 import coordinator_pb2 as pb

from .leader import Delivery, Leader
from .pending import Peer
from .rendezvous import RegisterError, Rendezvous
from .streams import (END, HEARTBEAT_INTERVAL_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_TIMEOUT_S,
                      LIVENESS_TIMEOUT_S, BadMessage, HelloRejected, Stream, StreamServer, decoded,
                      drain)
from .validation import clip, make_error

log = logging.getLogger("ddl.server")

# A goodbye whose reason starts so comes from a worker dying of an uncaught exception,
# exiting with calls in flight, or failing inside a collective (see ddl.runtime.runtime): the
# others are told it was lost, not that it left.
CRASH_REASON_PREFIXES = ("the process exited after an uncaught ", "the process exited while ",
                         "the process failed ")
LINK_ENDED = ("the link closed", "the link broke")  # a link's end, the cause unknown


class _Link:
    """The leader's side of one non-leader coordinator's PeerLink."""

    def __init__(self) -> None:
        self.out: "queue.Queue[object]" = queue.Queue()
        self.hello: Optional[pb.PeerHello] = None
        self.streams: Dict[int, Stream] = {}
        self.last_seen = time.monotonic()
        self.closed = False

    def describe(self) -> str:
        if self.hello is None:
            return "a peer coordinator that never said hello"
        return f"the coordinator of host {self.hello.hostname} (pid {self.hello.pid})"


class _LinkQueue:
    """Out queue of a relayed worker: puts ``(rank, message)`` onto its node's link.

    The end marker is dropped: the non-leader coordinator ends its worker's stream
    itself after forwarding an abort or a goodbye."""

    def __init__(self, link: _Link, rank: int):
        self._link = link
        self._rank = rank

    def put(self, item: object) -> None:
        if item is END:
            return
        if isinstance(item, HelloRejected):
            item = pb.CoordinatorMessage(abort=make_error(pb.INVALID, item.message))
        self._link.out.put((self._rank, item))


class CoordinatorServer(StreamServer):
    """The leader coordinator of one job, served over gRPC.

    ``address`` is ``unix:/abs/path.sock`` or ``host:port`` (port 0 picks a free one);
    :meth:`listen_also` adds a TCP address for peer coordinators. The job is over
    (:meth:`wait` returns True) once every rank registered and then left, by goodbye or
    by being lost, once a failed job has no open stream left, or once the server was
    stopped. :attr:`failed` tells whether it ended badly.
    """

    role = "leader"

    def __init__(self, job_id: str, secret_hex: str, size: int, address: str,
                 fusion_threshold: int = DEFAULT_THRESHOLD,
                 stall_check_time: float = default("stall_check_time"),
                 stall_shutdown_time: float = default("stall_shutdown_time"),
                 start_timeout: float = default("start_timeout"),
                 heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                 liveness_timeout: float = LIVENESS_TIMEOUT_S, report_dir: str = "",
                 cache_capacity: int = 0, keepalive_interval: float = KEEPALIVE_INTERVAL_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S, tuner=None):
        super().__init__(job_id, secret_hex, size, address, size, start_timeout,
                         heartbeat_interval, liveness_timeout, report_dir,
                         keepalive_interval, keepalive_timeout)
        self._leader = Leader(size, fusion_threshold, stall_check_time, stall_shutdown_time,
                              cache_capacity=cache_capacity, tuner=tuner)
        self._rdv = Rendezvous(job_id, size, start_timeout, max(0, int(fusion_threshold)),
                               cache_capacity=max(0, int(cache_capacity)))
        self._links: Set[_Link] = set()
        self._stopped_since: Dict[int, float] = {}  # starting rank -> first seen stopped
        checks = [t / 4 for t in (stall_check_time, stall_shutdown_time) if t > 0]
        self._tick_s = max(0.01, min([self._tick_s] + checks))

    def abort_job(self, kind: int, message: str, cause: str = "", host: str = "") -> None:
        """Send an Abort of ``kind`` to every worker and end their streams. With a
        ``cause``, the error names this coordinator (``host``, its pid) as the origin."""
        err = make_error(kind, message)
        if cause:
            err.cause, err.origin_host, err.origin_pid = cause, host, os.getpid()
        with self._lock:
            self._failed = True
            self._dispatch(self._leader.abort(err))

    def lose_rank_of(self, host: str, pid: int, cause: str) -> bool:
        """The rank whose process is ``pid`` on ``host`` is lost (``cause``): abort the job
        with PEER_LOST naming it, as when its stream closes. False if no rank is that
        process (or the job has failed already)."""
        with self._lock:
            rank = next((r for r in range(self.size)
                         if self._leader.peer(r) == Peer(host, pid)), None)
            if rank is None or self._failed:
                return False
            self._failed = True
            self._dispatch(self._leader.lost(rank, cause))
        return True

    def _on_stop(self) -> None:
        self._rdv.close()
        with self._lock:
            for link in self._links:
                link.out.put(END)

    def _registration_over(self) -> bool:
        """Every rank heard that the job failed: after a complete rendezvous, every rank
        opened its control stream (so it was told), left or ended (the launcher's exit
        record), or ``LATE_STREAM_WAIT_S`` passed; after a failed rendezvous, every
        rank registered, was answered with the error, is gone, or the start deadline
        passed. Until then a failed job keeps answering late ranks (a rank whose stream
        is still opening would otherwise find no coordinator and blame it)."""
        if self._rdv.complete():
            return self._every_rank_told(range(self.size))
        if not self._rdv.failed():
            return False
        if time.monotonic() >= self._rdv.deadline:
            return True
        return all(self._exit_record(r, wait=0) for r in self._rdv.unanswered())

    def _fatal_error(self) -> Optional[pb.Error]:
        return self._leader.fatal

    def _worker_pid(self, rank: int) -> int:
        with self._lock:
            return self._leader.peer(rank).pid

    def _ping(self) -> pb.PingResponse:
        return pb.PingResponse(job_id=self.job_id, registered=self._rdv.registered(),
                               size=self.size, leader=True, pid=os.getpid())

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
                s.out.put(END)
        if self._leader.fatal is not None:
            self._failed = True
        self._check_done()

    # -- monitor -----------------------------------------------------------------------
    def _tick(self) -> bool:
        if self._failed:  # a failed job ends once no late rank needs an answer
            with self._lock:
                self._check_done()
        if self._rdv.timed_out():
            log.error("no complete rendezvous within %g s: missing ranks %s",
                      self.start_timeout, self._rdv.missing())
            with self._lock:
                self._failed = True
                self._dispatch(self._leader.abort(make_error(
                    pb.SHUTDOWN, f"rendezvous timed out after {self.start_timeout:g} s; "
                                 f"missing ranks {self._rdv.missing()}")))
            self._done.set()
            return True
        self._check_starting_ranks()
        with self._lock:
            self._dispatch(self._leader.inspect_stalls())
            links = list(self._links)
        if self.liveness_timeout > 0:
            now = time.monotonic()
            for link in links:
                silent = now - link.last_seen
                if silent > self.liveness_timeout:
                    self._link_closed(link, f"no message for {silent:.1f} s (liveness "
                                            f"timeout {self.liveness_timeout:g} s)")
                    link.out.put(END)
        return False

    # -- Register ----------------------------------------------------------------------
    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                  ) -> pb.RegisterResponse:
        remaining = context.time_remaining()
        caller_deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            resp = self._rdv.register(request, context.is_active, caller_deadline)
        except RegisterError as exc:
            log.warning("%s", exc.message)
            if exc.code == "CANCELLED":  # the rank went away in the middle of init
                self._lose_starting_rank(request.rank, self._exit_record(request.rank) or
                                         "its registration call ended (its process exited "
                                         "or was interrupted)")
            if exc.missing:
                context.set_trailing_metadata(
                    (("ddl-missing-ranks", ",".join(map(str, exc.missing))),))
            context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        if resp.HasField("error"):
            return resp
        with self._lock:
            for p in resp.peers:
                self._leader.set_peer(p.rank, p.hostname, p.pid)
        return resp

    # -- ranks lost during ddl.init() --------------------------------------------------
    def _check_starting_ranks(self) -> None:
        """A rank that has no control stream yet is lost when the launcher saw its process
        end, when its process on this host (the launcher's ``pid.<rank>`` record) has
        stayed stopped for the keepalive timeout, or when it has not opened its stream
        ``liveness_timeout`` s after the rendezvous completed. Any other rank that never
        registers (one on another host, say) is named by the start timeout: it may just
        be slow to start."""
        with self._lock:
            if self._leader.fatal is not None or self._rdv.failed():
                return
            waiting = [r for r in range(self.size)
                       if r not in self._streams and r not in self._left]
        if not waiting:
            return
        now = time.monotonic()
        for rank in waiting:
            how = self._exit_record(rank, wait=0)
            if how:
                self._lose_starting_rank(rank, how)
                return
            # a rank the launcher started on this host that is stopped (SIGSTOP, a
            # debugger) is lost once it stays stopped as long as keepalive would wait
            if self.keepalive_timeout > 0 and _report.is_stopped(
                    _report.read_pid(self.report_dir, rank)):
                since = self._stopped_since.setdefault(rank, now)
                if now - since >= self.keepalive_timeout:
                    self._lose_starting_rank(
                        rank, f"its process is stopped (SIGSTOP or a debugger): frozen for "
                              f"{now - since:.1f} s")
                    return
            else:
                self._stopped_since.pop(rank, None)
        completed = self._rdv.completed_at
        if completed is not None and self.liveness_timeout > 0:
            silent = time.monotonic() - completed
            if silent > self.liveness_timeout:
                self._lose_starting_rank(
                    waiting[0], f"it did not open its control stream within {silent:.1f} s "
                                f"of the rendezvous (liveness timeout "
                                f"{self.liveness_timeout:g} s): frozen or unreachable")

    def _lose_starting_rank(self, rank: int, how: str) -> None:
        """``rank`` was lost before it opened its control stream: fail the rendezvous (if
        it is still open) and the job with PEER_LOST naming it and the phase it was in."""
        req = self._rdv.request(rank)
        if req is None:
            phase = "before it registered"
        elif not self._rdv.complete():
            phase = "while it waited for the other ranks to register"
        else:
            phase = "after the rendezvous, before it opened its control stream"
        who = f"rank {rank}" if req is None else (f"rank {rank} (host {req.hostname}, pid "
                                                  f"{req.pid})")
        err = pb.Error(kind=pb.PEER_LOST, rank_a=-1, rank_b=-1, origin_rank=rank,
                       origin_host=req.hostname if req else "", origin_pid=req.pid if req else 0,
                       cause=how, message=f"{who} was lost during ddl.init() ({phase}): {how}")
        with self._lock:
            if self._leader.fatal is not None or rank in self._streams:
                return
            log.error("%s", err.message)
            self._left.add(rank)
            self._failed = True
            self._rdv.fail(err)
            self._dispatch(self._leader.lost(rank, how, err))

    # -- worker streams ----------------------------------------------------------------
    def _accept_hello(self, stream: Stream, msg: pb.WorkerMessage) -> Optional[str]:
        problem = self._hello_problem(msg)
        if problem is not None:
            return problem
        rank = msg.hello.rank
        if not self._rdv.is_registered(rank):
            return f"negotiate: hello from rank {rank}, which has not registered"
        with self._lock:
            return self._bind_stream(stream, rank, self._leader.fatal)

    def _handle(self, stream: Stream, msg: pb.WorkerMessage) -> bool:
        rank = stream.rank
        assert rank is not None
        kind = msg.WhichOneof("kind")
        if kind == "requests":
            with self._lock:
                self._dispatch(self._leader.submit(rank, msg.requests.requests))
        elif kind == "goodbye":
            log.info("rank %d said goodbye (%s)", rank, msg.goodbye.reason or "no reason")
            reason = msg.goodbye.reason
            with self._lock:
                stream.goodbye = True
                if reason.startswith(CRASH_REASON_PREFIXES):
                    # dying of an exception: as fatal for the job as a crash
                    self._left.add(rank)
                    self._failed = True
                    self._dispatch(self._leader.lost(rank, reason))
                else:
                    self._dispatch(self._leader.goodbye(rank, reason))
                stream.out.put(END)
            return False
        elif kind == "hello":
            log.warning("negotiate: rank %d sent a second hello; ignored", rank)
        return True

    def _stream_closed(self, stream: Stream, cause: str = "",
                       err: Optional[pb.Error] = None) -> None:
        if not cause and err is None and self._is_lost(stream):
            cause = self._lost_cause(stream)
        with self._lock:
            lost = self._is_lost(stream)
            rank = self._close_bound(stream)
            if rank is None:
                return
            if lost:
                cause = cause or "its control stream closed without a goodbye"
                peer = self._leader.peer(rank)
                log.error("rank %d (host %s, pid %d) was lost: %s", rank, peer.host,
                          peer.pid, cause)
                self._failed = True
                self._dispatch(self._leader.lost(rank, cause, err))
            self._check_done()

    # -- peer links --------------------------------------------------------------------
    def _peer_link(self, request_iterator: Iterator[pb.PeerMessage],
                   context: grpc.ServicerContext) -> Iterator[pb.LeaderMessage]:
        link = _Link()
        with self._lock:
            if self._stopped:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the leader is stopping")
            self._links.add(link)
        context.add_callback(lambda: self._link_closed(link, "the link closed"))
        threading.Thread(target=self._link_read_loop, args=(request_iterator, link),
                         name="ddl-coord-link", daemon=True).start()
        hello_deadline = time.monotonic() + 10.0

        def on_idle(now: float) -> None:
            if link.hello is None and now >= hello_deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "peer link: no hello")

        heartbeat = lambda: pb.LeaderMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))
        for item in drain(link.out, context, heartbeat, lambda: link.hello is not None,
                          on_idle, self.heartbeat_interval):
            if isinstance(item, HelloRejected):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
            if isinstance(item, pb.LeaderMessage):  # a heartbeat
                yield item
                continue
            rank, msg = item  # type: ignore[misc]
            yield pb.LeaderMessage(workers=pb.RanksMessage(ranks=[rank], message=msg))

    def _link_read_loop(self, request_iterator: Iterator[pb.PeerMessage],
                        link: _Link) -> None:
        why = "the link closed"
        try:
            for msg in decoded(request_iterator, pb.PeerMessage):
                link.last_seen = time.monotonic()
                kind = msg.WhichOneof("kind")
                if link.hello is None:
                    refusal = self._link_hello_problem(msg)
                    if refusal is not None:
                        log.warning("%s", refusal)
                        link.out.put(HelloRejected(refusal))
                        return
                    link.hello = msg.hello
                    log.info("peer link from %s", link.describe())
                elif kind == "worker":
                    self._link_worker(link, msg.worker)
                elif kind == "closed":
                    stream = link.streams.get(msg.closed.rank)
                    if stream is not None:
                        self._stream_closed(stream, msg.closed.cause)
                elif kind == "hello":
                    log.warning("peer link: %s sent a second hello; ignored", link.describe())
            if link.hello is None:
                link.out.put(HelloRejected("peer link: the stream ended before hello"))
        except BadMessage as exc:
            why = str(exc)
            log.warning("peer link: %s: %s", link.describe(), why)
            link.out.put(HelloRejected(why))
        except Exception:  # the stream broke (cancelled, connection lost, stopping)
            why = "the link broke"
        finally:
            self._link_closed(link, why)
            link.out.put(END)  # the peer finished sending: end our side too

    def _link_hello_problem(self, msg: pb.PeerMessage) -> Optional[str]:
        kind = msg.WhichOneof("kind")
        if kind != "hello":
            return f"peer link: the first message must be hello, got {kind or 'nothing'}"
        if msg.hello.job_id != self.job_id:
            return (f"peer link: hello from host {clip(msg.hello.hostname)} names job "
                    f"{clip(msg.hello.job_id)!r}, but this leader serves job {self.job_id!r}")
        return None

    def _link_worker(self, link: _Link, rm: pb.RankMessage) -> None:
        """One relayed worker message: a hello binds the rank to the link."""
        stream = link.streams.get(rm.rank)
        if stream is None:
            stream = Stream(out=_LinkQueue(link, rm.rank), watch=False)  # type: ignore
            refusal = self._accept_hello(stream, rm.message)
            if refusal is None and rm.message.hello.rank != rm.rank:
                refusal = (f"peer link: a hello for rank {rm.message.hello.rank} was relayed "
                           f"as rank {rm.rank}")
            if refusal is not None:
                log.warning("%s (relayed by %s)", refusal, link.describe())
                stream.out.put(HelloRejected(refusal))
                return
            link.streams[rm.rank] = stream
            return
        if stream.closed:
            return
        if not self._handle(stream, rm.message):
            self._stream_closed(stream)

    def _link_closed(self, link: _Link, why: str) -> None:
        """Every rank still relayed over ``link`` is lost: COORDINATOR_LOST."""
        with self._lock:
            if link.closed:
                return
            link.closed = True
            self._links.discard(link)
            if self._stopped:
                return
            stranded = [s for s in link.streams.values() if not s.closed]
            if link.hello is not None:
                host = link.hello.hostname
                unbound = [r for r in range(self.size) if r not in self._streams
                           and self._rdv.is_registered(r)
                           and self._leader.peer(r).host == host]
            else:
                unbound = []
        if not stranded and not unbound:
            return
        ranks = sorted([s.rank for s in stranded if s.rank is not None] + unbound)
        if why in LINK_ENDED and self.keepalive_timeout > 0:
            why = f"{why}: it exited, or is {_keepalive.cause(self.keepalive_timeout)}"
        host = link.hello.hostname if link.hello else "?"
        pid = link.hello.pid if link.hello else 0
        err = make_error(pb.COORDINATOR_LOST,
                         f"{link.describe()} was lost: {why}; its ranks {ranks} are "
                         f"unreachable")
        err.origin_host, err.origin_pid, err.cause = host, pid, why
        log.error("%s", err.message)
        for stream in stranded:
            self._stream_closed(stream, why, err)
        with self._lock:
            for rank in unbound:
                self._left.add(rank)
                self._failed = True
                self._dispatch(self._leader.lost(rank, why, err))
