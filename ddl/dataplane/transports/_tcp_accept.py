"""The accept/handshake half of :class:`~ddl.dataplane.transports.tcp.TcpTransport`.

One acceptor thread per transport serves the server side of every pending handshake
(:class:`ddl.dataplane.transports._handshake.ServerSide`) on nonblocking sockets through
a selector, so a pending connection costs a file descriptor and a few hundred bytes, not
a thread. A connection that has not completed its handshake within
``HANDSHAKE_TIMEOUT`` (:data:`ddl.core.limits.UNAUTHENTICATED_DEADLINE_S`) is closed. At most
:func:`ddl.core.limits.pending_cap` connections wait at once; when full, the oldest gives way
to the newest (first the ones that have not sent a header of this job), so that a flood
of idle connections cannot keep a rank out, whose handshake takes one round trip. A
non-loopback address may hold only a share of them (every local process, ranks included,
connects from loopback, so no such share can apply there). Each closed, evicted or
refused connection is logged as a warning naming its address, at most once a second;
none is ever reported as a rank's failure. A completed handshake becomes the
transport's connection to the client's rank.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Dict, Optional, Tuple

from ddl.core import faults as _faults
from ddl.core import limits as _limits
from ddl.core.errors import DDLError, HandshakeError
from ddl.dataplane.transports import _handshake
from ddl.dataplane.transports._tcp_stream import _Conn

# the transport's one logger, under the name users know
log = logging.getLogger("ddl.dataplane.transports.tcp")

HANDSHAKE_TIMEOUT = _limits.UNAUTHENTICATED_DEADLINE_S

_WAKE = object()   # the selector key of close()'s wake-up


class _Pending:
    """An accepted connection whose handshake is under way (the acceptor thread's)."""
    __slots__ = ("sock", "host", "addr", "deadline", "side", "local", "inbuf", "out")

    def __init__(self, sock: socket.socket, host: str, addr: str, deadline: float,
                 side: "_handshake.ServerSide", local: bool):
        self.sock, self.host, self.addr, self.deadline = sock, host, addr, deadline
        self.side, self.local = side, local
        self.inbuf = bytearray()
        self.out = b""


class _Acceptor:
    """The acceptor of :class:`~ddl.dataplane.transports.tcp.TcpTransport` (a mixin: the
    transport holds the state below and calls :meth:`_init_acceptor` when built,
    :meth:`_start_accepting` from ``listen`` and :meth:`_stop_accepting` from ``close``)."""

    rank: int
    size: int
    _key: bytes
    _job: bytes
    _poll_interval: float
    _closed: bool
    _cond: threading.Condition
    _conns: Dict[int, _Conn]
    _broken: Dict[int, DDLError]

    def _init_acceptor(self) -> None:
        self._listener: Optional[socket.socket] = None
        self._acceptor: Optional[threading.Thread] = None
        # close() writes a byte here so that the acceptor's select returns at once
        self._wake: Optional[Tuple[socket.socket, socket.socket]] = None
        # the acceptor thread's own: pending handshakes in order of arrival, those that
        # have not sent a header of this job yet (evicted first) and those that have
        self._selector: Optional[selectors.BaseSelector] = None
        self._fresh: "OrderedDict[_Pending, None]" = OrderedDict()
        self._started: "OrderedDict[_Pending, None]" = OrderedDict()
        self._by_source: Dict[str, "OrderedDict[_Pending, None]"] = {}
        self._max_pending = _limits.MIN_PENDING
        self._last_warning = 0.0
        self._suppressed = 0

    def _start_accepting(self, listener: socket.socket) -> None:
        """Serve ``listener`` (bound, listening, nonblocking) in the acceptor thread."""
        self._listener = listener
        self._max_pending = _limits.pending_cap()
        self._selector = selectors.DefaultSelector()
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"ddl-tcp-accept-{self.rank}")
        try:
            self._acceptor.start()
        except BaseException:   # (no thread: it would have closed these)
            self._acceptor = None
            self._selector.close()
            for end in self._wake:
                end.close()
            raise

    def _stop_accepting(self) -> None:
        """Wake the acceptor thread, wait for it to close every pending connection, then
        close the listener (the transport is already marked closed)."""
        if self._wake is not None:
            try:
                self._wake[1].send(b"x")
            except OSError:
                pass  # the acceptor has already left and closed it
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=self._poll_interval + 1.0)
        if self._listener is not None:  # after the acceptor, which selects on it
            self._listener.close()

    # -- the acceptor: every pending handshake, one thread -------------------------------
    def pending_handshakes(self) -> int:
        """Accepted connections whose handshake has not finished yet."""
        return len(self._fresh) + len(self._started)

    def _accept_loop(self) -> None:
        sel = self._selector
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake[0], selectors.EVENT_READ, _WAKE)
        try:
            while not self._closed:
                for key, events in sel.select(self._poll_interval):
                    if self._closed or key.data is _WAKE:
                        break
                    if key.data is None:
                        self._accept_ready()
                    elif key.data in self._fresh or key.data in self._started:
                        self._step(key.data, events)
                self._expire(time.monotonic())
        finally:
            for p in list(self._fresh) + list(self._started):
                self._drop(p)
            sel.close()
            for end in self._wake:
                end.close()

    def _accept_ready(self) -> None:
        for _ in range(64):  # then serve the pending ones again
            try:
                sock, sockaddr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self.pending_handshakes():
                    self._drop(next(iter(self._fresh or self._started)),
                               f"this process ran out of file descriptors ({exc}); the "
                               f"oldest pending connection gives way")
                else:  # the listener stays readable: do not spin
                    self._warn(f"accept failed: {exc}")
                    time.sleep(min(0.05, self._poll_interval))
                return
            if _faults.ACTIVE is not None: _faults.hit("tcp.accept")
            host = sockaddr[0]
            addr = f"{host}:{sockaddr[1]}"
            p = _Pending(sock, host, addr, time.monotonic() + HANDSHAKE_TIMEOUT,
                         _handshake.ServerSide(self._key, self._job, self.rank, self.size,
                                               addr), _limits.is_loopback(host))
            self._make_room(p)
            sock.setblocking(False)
            self._fresh[p] = None
            if not p.local:
                self._by_source.setdefault(host, OrderedDict())[p] = None
            self._selector.register(sock, selectors.EVENT_READ, p)

    def _make_room(self, p: _Pending) -> None:
        """Evict the oldest pending connection when the listener is full, or when ``p``'s
        (non-loopback) address already holds its share; silent ones go first."""
        mine = None if p.local else self._by_source.get(p.host)
        if mine and len(mine) >= max(1, self._max_pending // _limits.PER_SOURCE_SHARE):
            old = next((q for q in mine if not q.side.started), next(iter(mine)))
            self._drop(old, f"{len(mine)} connections from {p.host} are waiting for a "
                            f"handshake; the oldest gives way")
        if self.pending_handshakes() >= self._max_pending:
            old = next(iter(self._fresh or self._started))
            self._drop(old, f"{self._max_pending} connections are waiting for a handshake; "
                            f"the oldest gives way")

    def _step(self, p: _Pending, events: int) -> None:
        side = p.side
        try:
            if events & selectors.EVENT_READ and side.need and not p.out:
                data = p.sock.recv(side.need - len(p.inbuf))
                if not data:
                    self._drop(p, f"it hung up during the handshake ({len(p.inbuf)} of "
                                  f"{side.need} bytes of its next message)")
                    return
                p.inbuf += data
                if len(p.inbuf) == side.need:
                    was_started = side.started
                    try:
                        p.out = side.received(bytes(p.inbuf))
                    except HandshakeError as exc:
                        self._refuse(p, exc)
                        return
                    p.inbuf.clear()
                    if side.started and not was_started:
                        del self._fresh[p]
                        self._started[p] = None
            if p.out:
                p.out = p.out[p.sock.send(p.out):]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._drop(p, f"{type(exc).__name__}: {exc}")
            return
        if not side.need and not p.out:
            self._promote(p)
            return
        self._selector.modify(p.sock, selectors.EVENT_WRITE if p.out else selectors.EVENT_READ,
                              p)

    def _expire(self, now: float) -> None:
        while self._fresh:
            p = next(iter(self._fresh))  # accepted first, so its deadline comes first
            if p.deadline > now:
                break
            self._drop(p, f"no data-plane handshake within {HANDSHAKE_TIMEOUT:g} s")
        for p in [p for p in self._started if p.deadline <= now]:
            self._drop(p, f"its handshake did not finish within {HANDSHAKE_TIMEOUT:g} s")

    def _forget(self, p: _Pending) -> None:
        self._fresh.pop(p, None)
        self._started.pop(p, None)
        mine = self._by_source.get(p.host)
        if mine is not None:
            mine.pop(p, None)
            if not mine:
                del self._by_source[p.host]
        try:
            self._selector.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, p: _Pending, why: str = "") -> None:
        self._forget(p)
        p.sock.close()
        if why:
            self._warn(f"closed the unauthenticated connection from {p.addr}: {why}")

    def _refuse(self, p: _Pending, exc: HandshakeError) -> None:
        if p.side.refusal:
            try:
                p.sock.send(p.side.refusal)
            except OSError:
                pass
        self._drop(p)
        self._warn(f"refused data-plane connection from {p.addr}: {exc}")

    def _promote(self, p: _Pending) -> None:
        self._forget(p)
        peer = p.side.client_rank
        try:
            conn = _Conn(p.sock, peer, p.addr)
        except OSError as exc:
            p.sock.close()
            self._warn(f"lost the connection from rank {peer} ({p.addr}) right after its "
                       f"handshake: {exc}")
            return
        with self._cond:
            if self._closed:
                conn.close()
                return
            old = self._conns.get(peer)
            self._conns[peer] = conn
            self._broken.pop(peer, None)
            self._cond.notify_all()
        if old is not None:
            self._warn(f"rank {peer} reconnected from {p.addr}; closing its old connection")
            old.close()

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning < 1.0:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} similar warnings suppressed)" if self._suppressed else ""
        self._last_warning = now
        self._suppressed = 0
        log.warning("rank %d data plane: %s%s", self.rank, message, more)
