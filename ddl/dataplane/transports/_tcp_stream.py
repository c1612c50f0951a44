"""Moving bytes over established TCP connections: the transfer half of
:class:`~ddl.dataplane.transports.tcp.TcpTransport`.

:class:`_Conn` is one authenticated, nonblocking socket to a peer. :class:`_Streams` is
the transport's transfer loop (both directions progressed in the calling thread, driven
by ``poll``) and the errors a transfer raises; a transfer that fails part-way closes the
connections it used (their byte streams are undefined) and records the error for every
later call with that peer.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Dict, Optional

from ddl.core import faults as _faults
from ddl.core.errors import DDLError, DDLTimeoutError, PeerLostError, ShutdownError
from ddl.dataplane.transports.base import AbortCheck

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT


def _as_bytes(buf) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class _Conn:
    __slots__ = ("sock", "fd", "peer", "addr")

    def __init__(self, sock: socket.socket, peer: int, addr: str):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.addr = addr

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _Streams:
    """The transfers of :class:`~ddl.dataplane.transports.tcp.TcpTransport` (a mixin: the
    transport holds the state below)."""

    rank: int
    _poll_interval: float
    _abort_check: AbortCheck
    _closed: bool
    _cond: threading.Condition
    _conns: Dict[int, _Conn]
    _broken: Dict[int, DDLError]

    def _transfer(self, sconn: Optional[_Conn], sview, rconn: Optional[_Conn], rview,
                  deadline: float, on_recv, chunk: int, what: str) -> None:
        ns = len(sview) if sconn else 0
        nr = len(rview) if rconn else 0
        if on_recv is not None and chunk <= 0:
            chunk = max(nr, 1)
        if _faults.ACTIVE is not None: _faults.hit("tcp.transfer")
        sent = recvd = done = 0
        poll_interval = self._poll_interval
        next_check = time.monotonic() + poll_interval
        try:
            while sent < ns or recvd < nr:
                progressed = False
                if sent < ns:
                    try:
                        sent += sconn.sock.send(sview[sent:])
                        progressed = True
                    except BlockingIOError:
                        pass
                    except OSError as exc:
                        raise self._lost(sconn, exc, what, "sending", sent, ns) from exc
                if recvd < nr:
                    try:
                        k = rconn.sock.recv_into(rview[recvd:])
                    except BlockingIOError:
                        k = -1
                    except OSError as exc:
                        raise self._lost(rconn, exc, what, "receiving", recvd, nr) from exc
                    if k == 0:
                        raise self._lost(rconn, None, what, "receiving", recvd, nr)
                    if k > 0:
                        recvd += k
                        progressed = True
                        if on_recv is not None:
                            while recvd - done >= chunk or (recvd == nr and done < nr):
                                stop = min(done + chunk, nr)
                                on_recv(done, stop)
                                done = stop
                if progressed and _faults.ACTIVE is not None: _faults.hit("tcp.chunk")
                now = time.monotonic()
                if progressed and now < next_check:
                    continue
                if now >= next_check:
                    next_check = now + poll_interval
                    self._abort_check()
                if now >= deadline:
                    raise self._timeout(sconn, rconn, what, sent, ns, recvd, nr)
                if progressed:
                    continue
                poller = select.poll()
                if sent < ns:
                    if rconn is sconn and recvd < nr:
                        poller.register(sconn.fd, _POLLIN | _POLLOUT)
                    else:
                        poller.register(sconn.fd, _POLLOUT)
                if recvd < nr and not (rconn is sconn and sent < ns):
                    poller.register(rconn.fd, _POLLIN)
                wait = min(next_check, deadline) - now
                poller.poll(max(1, int(wait * 1000.0 + 0.999)))
        except BaseException as exc:
            if sent < ns or recvd < nr:
                self._poison((sconn, rconn), exc, what)
            raise

    # -- errors --------------------------------------------------------------------------
    def _lost(self, conn: _Conn, exc: Optional[BaseException], what: str, doing: str,
              done: int, total: int) -> DDLError:
        if self._closed:
            return ShutdownError(f"the data-plane transport of rank {self.rank} was closed "
                                 f"during {what} with rank {conn.peer}", rank=self.rank)
        cause = "end of stream" if exc is None else f"{type(exc).__name__}: {exc}"
        host = conn.addr.rpartition(":")[0]
        return PeerLostError(
            f"rank {conn.peer} ({conn.addr}) closed the data-plane connection during {what} "
            f"(rank {self.rank} was {doing}, {done} of {total} bytes done): {cause}",
            rank=conn.peer, host=host, cause=cause)

    def _timeout(self, sconn, rconn, what, sent, ns, recvd, nr) -> DDLTimeoutError:
        parts = []
        if sconn is not None:
            parts.append(f"sent {sent} of {ns} bytes to rank {sconn.peer} ({sconn.addr})")
        if rconn is not None:
            parts.append(f"received {recvd} of {nr} bytes from rank {rconn.peer} "
                         f"({rconn.addr})")
        return DDLTimeoutError(f"{what} on rank {self.rank} passed its deadline: "
                               + "; ".join(parts), op=what)

    def _poison(self, conns, exc: BaseException, what: str) -> None:
        """Close connections whose byte stream a failed transfer left undefined."""
        with self._cond:
            for conn in conns:
                if conn is None or self._conns.get(conn.peer) is not conn:
                    continue
                del self._conns[conn.peer]
                if isinstance(exc, PeerLostError) and exc.rank == conn.peer:
                    err: DDLError = exc
                else:
                    err = PeerLostError(
                        f"the data-plane connection to rank {conn.peer} ({conn.addr}) was "
                        f"abandoned after {what} failed: {type(exc).__name__}: {exc}",
                        rank=conn.peer, cause=str(exc))
                self._broken[conn.peer] = err
                conn.close()
