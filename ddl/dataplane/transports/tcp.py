"""TCP transport: one persistent, authenticated socket per pair of ranks.

For a pair (a, b) the lower rank dials and the higher rank accepts; the connection then
carries both directions. Connections open lazily on first use (or eagerly through
:meth:`TcpTransport.connect_all`) and stay open until :meth:`TcpTransport.close`.

Transfers run on nonblocking sockets driven by ``poll``: :meth:`TcpTransport.sendrecv`
progresses both directions in the calling thread, so a ring of ranks never deadlocks,
and it hands each completed chunk of the receive buffer to ``on_recv`` while the next
is in flight. Each wait lasts at most ``poll_interval``; between waits the transport
checks the deadline and calls ``abort_check``.

Socket buffers are left to the kernel's autotuning (``net.ipv4.tcp_rmem``/``tcp_wmem``):
setting ``SO_RCVBUF`` would switch it off and cap the window at ``net.core.rmem_max``,
which measured slower here (4 ranks, 64-256 MiB allreduce: 10-15 %).

Accepting: one acceptor thread per transport serves the server side of every pending
handshake (:class:`ddl.dataplane.transports._handshake.ServerSide`) on nonblocking sockets through
a selector, so a pending connection costs a file descriptor and a few hundred bytes, not
a thread. A connection that has not completed its handshake within
``HANDSHAKE_TIMEOUT`` (:data:`ddl.core.limits.UNAUTHENTICATED_DEADLINE_S`) is closed. At most
:func:`ddl.core.limits.pending_cap` connections wait at once; when full, the oldest gives way
to the newest (first the ones that have not sent a header of this job), so that a flood
of idle connections cannot keep a rank out, whose handshake takes one round trip. A
non-loopback address may hold only a share of them (every local process, ranks included,
connects from loopback, so no such share can apply there). Each closed, evicted or
refused connection is logged as a warning naming its address, at most once a second;
none is ever reported as a rank's failure.

Thread-safety: different threads may use the transport at once with different peers
(e.g. disjoint process sets); two threads must not talk to the same peer at once.

A transfer that fails part-way (peer lost, deadline, abort) leaves the byte stream of
that connection undefined, so the connection is closed and every later call with that
peer raises the same error.
"""

from __future__ import annotations

import errno
import logging
import select
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

from ddl.core import faults as _faults
from ddl.core import limits as _limits
from ddl.core.config import default
from ddl.core.errors import DDLError, DDLTimeoutError, HandshakeError, PeerLostError, ShutdownError
from ddl.dataplane.transports import _handshake
from ddl.dataplane.transports.base import AbortCheck, Transport

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = _limits.UNAUTHENTICATED_DEADLINE_S

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT


_WAKE = object()   # the selector key of close()'s wake-up


def _no_abort() -> None:
    return None


def _split_address(address: str):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"data-plane address {address!r} is not of the form host:port")
    return host.strip("[]"), int(port)


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


class _Pending:
    """An accepted connection whose handshake is under way (the acceptor thread's)."""
    __slots__ = ("sock", "host", "addr", "deadline", "side", "local", "inbuf", "out")

    def __init__(self, sock: socket.socket, host: str, addr: str, deadline: float,
                 side: "_handshake.ServerSide", local: bool):
        self.sock, self.host, self.addr, self.deadline = sock, host, addr, deadline
        self.side, self.local = side, local
        self.inbuf = bytearray()
        self.out = b""


class TcpTransport(Transport):
    """Point-to-point TCP between the ranks of one job, authenticated with the job secret.

    Every rank calls :meth:`listen` first, publishes the address it returns through the
    rendezvous, then calls :meth:`set_peers` with every rank's address.
    """

    name = "tcp"

    def __init__(self, rank: int, size: int, secret_key: bytes, job_id: str,
                 bind_address: str = "127.0.0.1", abort_check: AbortCheck = _no_abort,
                 poll_interval: float = 0.2, connect_timeout: float = default("start_timeout")):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"TcpTransport: rank {rank} is outside 0..{size - 1}")
        if not secret_key:
            raise ValueError("TcpTransport: the job secret must not be empty")
        if poll_interval <= 0:
            raise ValueError(f"TcpTransport: poll_interval must be > 0, got {poll_interval}")
        self.rank = rank
        self.size = size
        self._key = bytes(secret_key)
        self._job = _handshake.job_id_bytes(job_id)
        self._bind_address = bind_address
        self._abort_check = abort_check
        self._poll_interval = poll_interval
        self._connect_timeout = connect_timeout
        self._peers: Dict[int, str] = {}
        self._conns: Dict[int, _Conn] = {}
        self._broken: Dict[int, DDLError] = {}
        self._cond = threading.Condition()
        self._dial_locks: Dict[int, threading.Lock] = {}
        self._closed = False
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

    # -- setup ---------------------------------------------------------------------------
    def listen(self) -> str:
        """Bind a free port on ``bind_address``, start accepting; returns ``host:port``."""
        if self._listener is not None:
            raise RuntimeError("TcpTransport.listen() was already called")
        infos = socket.getaddrinfo(self._bind_address, 0, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(sockaddr)
            ls.listen(socket.SOMAXCONN)
            ls.setblocking(False)
            host, port = ls.getsockname()[:2]
            if host in ("0.0.0.0", "::"):
                host = socket.gethostbyname(socket.gethostname())
        except BaseException:
            ls.close()
            raise
        self._listener = ls
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
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def set_peers(self, addresses: Mapping[int, str]) -> None:
        """Every rank's data-plane address (``{rank: "host:port"}``)."""
        for rank, address in addresses.items():
            _split_address(address)
            self._peers[int(rank)] = address

    def connect_all(self, ranks: Iterable[int], deadline: float) -> None:
        """Open the connections to ``ranks`` now instead of on first use."""
        ranks = [r for r in ranks if r != self.rank]
        for r in sorted(ranks, key=lambda r: r < self.rank):  # dial first, then wait
            self._conn(r, deadline, "connect_all")

    def address_of(self, peer: int) -> str:
        return self._peers.get(peer, "unknown address")

    # -- transfers -----------------------------------------------------------------------
    def send(self, peer: int, buf: memoryview, deadline: float) -> None:
        view = _as_bytes(buf)
        if len(view):
            self._transfer(self._conn(peer, deadline, "send"), view, None, None, deadline,
                           None, 0, "send")

    def recv_into(self, peer: int, buf: memoryview, deadline: float) -> None:
        view = _as_bytes(buf)
        if len(view):
            self._transfer(None, None, self._conn(peer, deadline, "recv"), view, deadline,
                           None, 0, "recv")

    def sendrecv(self, send_peer: int, send_buf: memoryview, recv_peer: int,
                 recv_buf: memoryview, deadline: float,
                 on_recv: Optional[Callable[[int, int], None]] = None,
                 chunk: int = 0) -> None:
        sview = _as_bytes(send_buf)
        rview = _as_bytes(recv_buf)
        sconn = self._conn(send_peer, deadline, "sendrecv") if len(sview) else None
        rconn = self._conn(recv_peer, deadline, "sendrecv") if len(rview) else None
        if sconn is None and rconn is None:
            return
        self._transfer(sconn, sview if sconn else None, rconn, rview if rconn else None,
                       deadline, on_recv, chunk, "sendrecv")

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

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning < 1.0:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} similar warnings suppressed)" if self._suppressed else ""
        self._last_warning = now
        self._suppressed = 0
        log.warning("rank %d data plane: %s%s", self.rank, message, more)

    # -- connections ---------------------------------------------------------------------
    def _conn(self, peer: int, deadline: float, what: str) -> _Conn:
        conn = self._conns.get(peer)
        if conn is not None:
            return conn
        if self._closed:
            raise ShutdownError(f"{what} on rank {self.rank}: the data-plane transport is "
                                f"closed", rank=self.rank)
        if peer in self._broken:
            raise self._broken[peer]
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{what} on rank {self.rank}: peer rank {peer} is not another "
                             f"rank of 0..{self.size - 1}")
        if self.rank < peer:
            with self._cond:
                lock = self._dial_locks.setdefault(peer, threading.Lock())
            with lock:
                conn = self._conns.get(peer)
                return conn if conn is not None else self._dial(peer, deadline)
        return self._await_accept(peer, deadline, what)

    def _dial(self, peer: int, deadline: float) -> _Conn:
        address = self._peers.get(peer)
        if address is None:
            raise ValueError(f"rank {self.rank} has no data-plane address for rank {peer}; "
                             f"call set_peers() with every rank's address first")
        host, port = _split_address(address)
        start = time.monotonic()
        stop = min(deadline, start + self._connect_timeout)
        delay, last = 0.005, None
        while True:
            self._abort_check()
            remaining = stop - time.monotonic()
            if remaining <= 0:
                raise DDLTimeoutError(
                    f"rank {self.rank} could not connect to rank {peer} at {address} within "
                    f"{time.monotonic() - start:.1f} s: {last}", op="connect",
                    timeout=stop - start)
            sock = None
            try:
                family, _, _, _, sockaddr = socket.getaddrinfo(
                    host, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.settimeout(min(remaining, self._poll_interval * 5))
                sock.connect(sockaddr)
                break
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
                if sock is not None:
                    sock.close()
                time.sleep(max(0.0, min(delay, stop - time.monotonic())))
                delay = min(delay * 2, self._poll_interval)
        if _faults.ACTIVE is not None: _faults.hit("tcp.dial")
        try:
            _handshake.client(sock, self._key, self._job, self.rank, peer,
                              min(stop, time.monotonic() + HANDSHAKE_TIMEOUT), address)
        except HandshakeError as exc:
            sock.close()
            if exc.connection_lost:  # the peer died (or hung up) mid-handshake
                raise PeerLostError(
                    f"rank {peer} ({address}) closed the data-plane connection during the "
                    f"handshake with rank {self.rank}: it died, or refused this job's "
                    f"credentials ({exc})", rank=peer, cause="handshake") from None
            raise
        conn = _Conn(sock, peer, address)
        with self._cond:
            if self._closed:
                conn.close()
                raise ShutdownError(f"rank {self.rank}: the data-plane transport was closed "
                                    f"while connecting to rank {peer}", rank=self.rank)
            self._conns[peer] = conn
        return conn

    def _await_accept(self, peer: int, deadline: float, what: str) -> _Conn:
        # Bounded by the call's deadline only: the lower rank dials when it reaches the
        # same collective, which may be much later than this rank (a slow data loader).
        start = time.monotonic()
        stop = deadline
        with self._cond:
            while True:
                conn = self._conns.get(peer)
                if conn is not None:
                    return conn
                if self._closed:
                    raise ShutdownError(f"{what} on rank {self.rank}: the data-plane "
                                        f"transport is closed", rank=self.rank)
                if peer in self._broken:
                    raise self._broken[peer]
                self._abort_check()
                now = time.monotonic()
                if now >= stop:
                    raise DDLTimeoutError(
                        f"{what} on rank {self.rank}: rank {peer} "
                        f"({self.address_of(peer)}) did not connect within "
                        f"{now - start:.1f} s", op=what, timeout=stop - start)
                self._cond.wait(min(self._poll_interval, stop - now))

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

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
            self._cond.notify_all()
        for conn in conns:
            conn.close()
        if self._wake is not None:
            try:
                self._wake[1].send(b"x")
            except OSError:
                pass  # the acceptor has already left and closed it
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=self._poll_interval + 1.0)
        if self._listener is not None:  # after the acceptor, which selects on it
            self._listener.close()
