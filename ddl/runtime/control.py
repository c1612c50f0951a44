"""The worker's side of the control plane: a gRPC channel to its node's coordinator.

:class:`ControlClient` registers the worker (rendezvous, topology) and runs the
``Negotiate`` stream: requests go out in batches from a queue; incoming messages are
handed to callbacks on a reader thread. Every call has a deadline; a broken stream is
reported once through ``on_lost``. The channel pings the coordinator with HTTP/2
keepalive (:mod:`ddl.core.keepalive`), so a frozen coordinator breaks the stream within
about 1 s + ``keepalive_timeout``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator, List, Optional

import grpc

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.core import keepalive as _keepalive
from ddl.core import report as _report
from ddl.core.errors import CoordinatorLostError, DDLError, DDLTimeoutError, PeerLostError
from ddl.v1 import coordinator_pb2 as pb
from ddl.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("ddl")

_STOP = object()
PAUSE_S = 0.25  # the request loop this much later than its heartbeat: this process paused
VERIFY_S = 1.0  # after a pause and a broken stream: how long the coordinator has to answer
GONE_WAIT_S = 0.2  # a broken stream: how long the coordinator's process may take to end
RECONNECT_MS = 100  # the channel's first reconnect backoff (gRPC's default: 1 s)


class ControlClient:
    """One worker's connection to its coordinator."""

    def __init__(self, address: str, job_id: str, secret_hex: str, rank: int,
                 heartbeat_interval: float = _config.default("heartbeat_interval"),
                 liveness_timeout: float = _config.default("liveness_timeout"),
                 keepalive_interval: float = _config.default("keepalive_interval"),
                 keepalive_timeout: float = _config.default("keepalive_timeout"),
                 report_dir: str = ""):
        self.address = address
        self.report_dir = report_dir  # the launcher's records (the coordinator's pid)
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.heartbeat_interval = heartbeat_interval
        self.liveness_timeout = liveness_timeout  # 0: never give up on a silent coordinator
        self._last_recv = time.monotonic()
        self._last_tick = time.monotonic()  # last run of the liveness check
        self._pause = (0.0, 0.0)  # (end, length) of the last pause of this process
        self._on_lost: Optional[Callable[[BaseException], None]] = None
        self.job_id = job_id
        self.rank = rank
        self._metadata = ((_auth.GRPC_METADATA_KEY, _auth.grpc_token(secret_hex, job_id)),)
        options = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.enable_http_proxy", 0),
                   # reconnect soon after a break: see _coordinator_answers
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS),
                   ("grpc.min_reconnect_backoff_ms", RECONNECT_MS)]
        options += _keepalive.channel_options(keepalive_interval, keepalive_timeout)
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._outbox: "queue.Queue" = queue.Queue()
        self._reader: Optional[threading.Thread] = None
        self._call = None
        self._closing = False

    # -- rendezvous ------------------------------------------------------------------
    def register(self, *, size: int, hostname: str, pid: int, data_address: str,
                 timeout: float, cycle_address: str = "") -> pb.RegisterResponse:
        """Register and wait for every rank; raises a named error after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        self._await_channel(deadline, timeout)
        request = pb.RegisterRequest(rank=self.rank, size=size, hostname=hostname, pid=pid,
                                     data_address=data_address, job_id=self.job_id,
                                     cycle_address=cycle_address)
        try:
            reply = self._stub.Register(request, timeout=max(0.1, deadline - time.monotonic()),
                                        metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                missing = _missing_ranks(exc)
                if missing:
                    cause = f"it did not register within {timeout:g} s (DDL_START_TIMEOUT)"
                    raise DDLTimeoutError(
                        f"rank{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} did not register with the "
                        f"coordinator within {timeout:g} s (DDL_START_TIMEOUT): not started, "
                        f"slow to start, or frozen; check that every worker starts, or "
                        f"raise --start-timeout", op="init", timeout=timeout,
                        rank=missing[0], cause=cause) from None
                raise DDLTimeoutError(
                    f"rank {self.rank}: not every rank registered within {timeout:g} s "
                    f"(DDL_START_TIMEOUT): {exc.details() or 'deadline exceeded'}",
                    op="init", timeout=timeout) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise CoordinatorLostError(
                    f"rank {self.rank}: the coordinator at {self.address} went away during "
                    f"init: {exc.details()}", cause="unavailable") from None
            raise DDLError(f"rank {self.rank}: registration failed ({code.name}): "
                           f"{exc.details()}", op="init") from None
        if reply.HasField("error"):  # a rank was lost before the rendezvous completed
            from ddl.runtime.engine import error_from_proto
            raise error_from_proto(reply.error)
        return reply

    def _await_channel(self, deadline: float, timeout: float) -> None:
        """Wait until the channel to the coordinator is up; CoordinatorLostError at the
        deadline, or as soon as the coordinator's process (when the launcher recorded it
        on this host) has stayed stopped for the keepalive timeout: a stopped process
        takes the connection into its listen queue but never answers it."""
        # Ping, not grpc.channel_ready_future: a ready future leaves gRPC's connectivity
        # poller running for 0.2 s after it resolves, and closing the channel waits for
        # it (a shutdown soon after init took 0.2 s longer)
        pid = _report.read_pid(self.report_dir, self.address)
        stopped_since = None
        attempt = 0.1   # doubles up to 1 s: a coordinator starved of CPU answers late
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorLostError(
                    f"rank {self.rank}: could not reach the coordinator at {self.address} "
                    f"within {timeout:g} s (DDL_START_TIMEOUT); is it running?",
                    cause="unreachable")
            try:
                self._stub.Ping(pb.PingRequest(), timeout=min(attempt, remaining),
                                metadata=self._metadata, wait_for_ready=True)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    return  # it answers; Register reports what is wrong
            attempt = min(2 * attempt, 1.0)
            if not (pid and self.keepalive_timeout > 0 and _report.is_stopped(pid)):
                stopped_since = None
                continue
            now = time.monotonic()
            stopped_since = stopped_since or now
            if now - stopped_since >= self.keepalive_timeout:
                cause = (f"its process is stopped (SIGSTOP or a debugger): frozen for "
                         f"{now - stopped_since:.1f} s")
                raise CoordinatorLostError(
                    f"rank {self.rank}: the coordinator at {self.address} (pid {pid}) was "
                    f"lost during ddl.init(): {cause}", cause=cause, pid=pid)

    # -- negotiation stream ----------------------------------------------------------
    def start_stream(self, on_message: Callable[[pb.CoordinatorMessage], None],
                     on_lost: Callable[[BaseException], None]) -> None:
        """Open ``Negotiate`` and start the reader thread. A coordinator silent for the
        liveness timeout counts as lost (``on_lost`` with CoordinatorLostError)."""
        self._on_lost = on_lost
        self._last_recv = time.monotonic()
        self._call = self._stub.Negotiate(self._requests(), metadata=self._metadata)

        def read() -> None:
            try:
                for message in self._call:
                    self._last_recv = time.monotonic()
                    on_message(message)
                if not self._closing:
                    on_lost(CoordinatorLostError(
                        f"rank {self.rank}: the coordinator at {self.address} closed the "
                        f"control stream", cause="stream closed"))
            except grpc.RpcError as exc:
                if not self._closing:
                    on_lost(self._broken(exc))
            except BaseException as exc:  # a bug in a callback must still surface
                on_lost(exc)

        self._reader = threading.Thread(target=read, name="ddl-control-reader", daemon=True)
        self._reader.start()

    def _broken(self, exc: grpc.RpcError) -> BaseException:
        """The error for a stream that failed with ``exc``. If this process itself did
        not run for a while (it was stopped) and the coordinator still answers, the
        coordinator dropped *this* rank: say so rather than blame the coordinator."""
        code, details = exc.code(), exc.details() or ""
        now = time.monotonic()
        paused = now - self._last_tick
        end, length = self._pause
        if now - end < 2 * self.heartbeat_interval + 1.0:  # the loop saw it first
            paused = max(paused, length)
        if (code == grpc.StatusCode.UNAVAILABLE and self.keepalive_timeout > 0
                and paused > self.heartbeat_interval + PAUSE_S and self._coordinator_answers()):
            cause = (f"this process did not run for {paused:.1f} s (stopped?), and its "
                     f"control stream to the coordinator at {self.address} broke meanwhile "
                     f"({code.name}: {details}) while the coordinator still answers")
            return PeerLostError(f"rank {self.rank} was lost: {cause}", rank=self.rank,
                                 cause=cause)
        pid = _report.read_pid(self.report_dir, self.address)   # when on this host
        state = _report.process_state(pid) if pid else "?"
        if pid and state not in ("", "Z", "X", "T", "t") and not (
                _keepalive.is_keepalive_failure(details)):
            # a killed process closes its sockets a moment before it is gone
            settle = time.monotonic() + GONE_WAIT_S
            while state not in ("", "Z", "X") and time.monotonic() < settle:
                time.sleep(0.01)
                state = _report.process_state(pid)
        what = (f"the coordinator at {self.address}" if not pid else
                f"the coordinator (pid {pid}) at {self.address}")
        if state in ("", "Z", "X"):   # gone: killed, or it crashed
            cause = f"its process has exited ({code.name}: {details})"
            return CoordinatorLostError(f"rank {self.rank}: lost {what}: {cause}",
                                        cause=cause, pid=pid)
        if 0 < self.keepalive_timeout and _keepalive.is_keepalive_failure(details):
            cause = _keepalive.cause(self.keepalive_timeout)
            if state in ("T", "t"):
                cause = f"its process is stopped (SIGSTOP or a debugger): {cause}"
            return CoordinatorLostError(
                f"rank {self.rank}: lost {what}: {cause} ({code.name}: {details})",
                cause=cause, pid=pid)
        return CoordinatorLostError(
            f"rank {self.rank}: lost {what}: {code.name}: {details}", cause=code.name,
            pid=pid)

    def _coordinator_answers(self) -> bool:
        """Whether the coordinator answers a Ping within :data:`VERIFY_S` s."""
        try:
            reply = self._stub.Ping(pb.PingRequest(), timeout=VERIFY_S,
                                    metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError:
            return False
        return reply.job_id == self.job_id

    def _requests(self) -> Iterator[pb.WorkerMessage]:
        yield pb.WorkerMessage(hello=pb.Hello(rank=self.rank, job_id=self.job_id))
        held = None   # a Goodbye or the stop that ended a batch: next, in its turn
        while True:
            self._check_liveness()
            if held is not None:
                item, held = held, None
            else:
                try:
                    item = self._outbox.get(timeout=self.heartbeat_interval)
                except queue.Empty:
                    yield pb.WorkerMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))
                    continue
            if item is _STOP:
                return
            if isinstance(item, pb.Goodbye):
                yield pb.WorkerMessage(goodbye=item)
                continue
            batch: List[pb.Request] = list(item)
            while True:  # drain whatever else is queued into the same message
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP or isinstance(more, pb.Goodbye):
                    # kept here, not put back: behind a stop queued after it, a Goodbye
                    # would never leave, and the coordinator would call this rank lost
                    held = more
                    break
                batch.extend(more)
            yield pb.WorkerMessage(requests=pb.RequestList(rank=self.rank, requests=batch))

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now - self._last_tick > self.heartbeat_interval + PAUSE_S:
            self._pause = (now, now - self._last_tick)
        if self.liveness_timeout > 0 and now - self._last_tick > self.liveness_timeout:
            # This loop itself did not run for that long: this process was stopped (or
            # starved), not the coordinator. Give the coordinator's messages a chance.
            self._last_recv = now
        self._last_tick = now
        silent = now - self._last_recv
        if (self.liveness_timeout <= 0 or silent <= self.liveness_timeout or self._closing
                or self._on_lost is None):
            return
        on_lost, self._on_lost = self._on_lost, None  # report once
        cause = (f"it sent nothing for {silent:.1f} s (liveness timeout "
                 f"{self.liveness_timeout:g} s): {_keepalive.silence(self.keepalive_interval, self.keepalive_timeout, self.liveness_timeout)}")
        on_lost(CoordinatorLostError(
            f"rank {self.rank}: the coordinator at {self.address} was lost: {cause}",
            cause=cause))
        if self._call is not None:
            self._call.cancel()

    def send(self, requests: List[pb.Request]) -> None:
        """Queue requests; they leave in one batch with whatever else is queued."""
        self._outbox.put(requests)

    def close(self, reason: str = "shutdown", timeout: float = 2.0) -> None:
        """Say goodbye, end the stream and close the channel, within ``timeout`` s."""
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + timeout
        if self._call is not None:
            self._outbox.put(pb.Goodbye(rank=self.rank, reason=reason))
            self._outbox.put(_STOP)
            if self._reader is not None:
                self._reader.join(max(0.0, deadline - time.monotonic()))
            if self._reader is not None and self._reader.is_alive():
                self._call.cancel()
                self._reader.join(0.5)
        self._channel.close()


def _missing_ranks(exc: grpc.RpcError) -> List[int]:
    """The ranks a timed-out rendezvous lacked (its trailing metadata), or []."""
    try:
        for key, value in exc.trailing_metadata() or ():
            if key == "ddl-missing-ranks":
                return [int(r) for r in value.split(",") if r]
    except (AttributeError, ValueError):
        pass
    return []
