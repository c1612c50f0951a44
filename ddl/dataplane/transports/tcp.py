"""TCP transport: one persistent, authenticated socket per pair of ranks.

For a pair (a, b) the lower rank dials and the higher rank accepts; the connection then
carries both directions. Connections open lazily on first use (or eagerly through
:meth:`TcpTransport.connect_all`) and stay open until :meth:`TcpTransport.close`.

Transfers run on nonblocking sockets driven by ``poll``: :meth:`TcpTransport.sendrecv`
progresses both directions in the calling thread, so a ring of ranks never deadlocks,
and it hands each completed chunk of the receive buffer to ``on_recv`` while the next
is in flight. Each wait lasts at most ``poll_interval``; between waits the transport
checks the deadline and calls ``abort_check`` (:mod:`ddl.dataplane.transports._tcp_stream`).

Socket buffers are left to the kernel's autotuning (``net.ipv4.tcp_rmem``/``tcp_wmem``):
setting ``SO_RCVBUF`` would switch it off and cap the window at ``net.core.rmem_max``,
which measured slower here (4 ranks, 64-256 MiB allreduce: 10-15 %).

Accepting: one acceptor thread per transport serves every pending handshake on
nonblocking sockets through a selector, with a deadline, a cap on pending connections
and eviction of the oldest (:mod:`ddl.dataplane.transports._tcp_accept`), so that a
flood of idle connections cannot keep a rank out.

Thread-safety: different threads may use the transport at once with different peers
(e.g. disjoint process sets); two threads must not talk to the same peer at once.

A transfer that fails part-way (peer lost, deadline, abort) leaves the byte stream of
that connection undefined, so the connection is closed and every later call with that
peer raises the same error.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Dict, Iterable, Mapping, Optional

from ddl.core import faults as _faults
from ddl.core.config import default
from ddl.core.errors import DDLError, DDLTimeoutError, HandshakeError, PeerLostError, ShutdownError
from ddl.dataplane.transports import _handshake, _tcp_accept
from ddl.dataplane.transports._tcp_accept import _Acceptor
from ddl.dataplane.transports._tcp_stream import _as_bytes, _Conn, _Streams
from ddl.dataplane.transports.base import AbortCheck, Transport


def _no_abort() -> None:
    return None


def _split_address(address: str):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"data-plane address {address!r} is not of the form host:port")
    return host.strip("[]"), int(port)


class TcpTransport(_Acceptor, _Streams, Transport):
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
        self._init_acceptor()

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
        self._start_accepting(ls)
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
                              min(stop, time.monotonic() + _tcp_accept.HANDSHAKE_TIMEOUT),
                              address)
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
        self._stop_accepting()
