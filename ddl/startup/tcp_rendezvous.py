"""Start-up without a launcher: ranks that know their rank, the job size, the job secret
and one address meet over TCP (Kubernetes pods, containers, any scheduler that starts
one process per rank and can hand each the same secret).

Every process sets ``DDL_RANK``, ``DDL_SIZE``, ``DDL_JOB_SECRET`` (hex, from a secret
store, never a command line) and ``DDL_RENDEZVOUS_ADDR`` (``host:port`` of rank 0; rank 0
listens on that port). Rank 0 accepts one connection from every other rank; each proves
it knows the secret with the data plane's handshake
(:mod:`ddl.dataplane.transports._handshake`) before rank 0 reads anything else, the
listener taking the identity ``size`` (one past the last rank), so no data-plane proof
can be replayed here. Then the connections carry the few JSON messages of the
communicator bootstrap (:func:`ddl.startup.bootstrap.start_job`): rank 0 starts the
leader coordinator, the first rank of every other host a relay, and every rank learns
its node's coordinator. The connections close when ``init`` returns.

Every wait is bounded by ``DDL_START_TIMEOUT``: a rank that cannot reach rank 0, or rank
0 waiting for ranks that never come, raises :class:`~ddl.core.errors.DDLTimeoutError`
naming the address and the ranks missing.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from typing import Any, Callable, Dict, List, Optional

from ddl.core import auth as _auth
from ddl.core.errors import BootstrapError, ConfigError, DDLTimeoutError, HandshakeError
from ddl.dataplane.transports import _handshake

_LEN = struct.Struct("!I")
MAX_MESSAGE = 1 << 20  # a bootstrap message is a few hundred bytes of JSON
_RETRY_S = 0.2


def job_id_of(secret: str) -> str:
    """The job id when none is given: derived from the secret, so pods need only one."""
    return hashlib.sha256(b"ddl-job-id" + secret.encode()).hexdigest()[:16]


def split_address(addr: str, variable: str = "DDL_RENDEZVOUS_ADDR", any_port: bool = False):
    """(host, port) of ``host:port``; port 0 (any free one) only with ``any_port``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or \
            not (0 if any_port else 1) <= int(port) < 65536:
        raise ConfigError(f"{variable}={addr!r} is not valid: expected host:port, e.g. "
                          f"ddl-job-0.ddl-job:29400", variable=variable, value=addr)
    return host.strip("[]"), int(port)


class TcpComm:
    """The bootstrap's communicator over a star of authenticated TCP connections: what
    :func:`ddl.startup.bootstrap.start_job` needs (rank, size, JSON broadcast and
    allgather), collective over the job's ranks."""

    def __init__(self, rank: int, size: int, addr: str, secret: str, job_id: str,
                 deadline: float, timeout: float,
                 announce: Optional[Callable[[int], None]] = None):
        """``announce``, on rank 0 only: called with the port rank 0 listens on once it
        does (``addr``'s port may then be 0, any free port), for the other ranks to learn
        it some other way (torchrun's store)."""
        self.rank, self.size, self.addr = rank, size, addr
        self._announce = announce
        self._deadline, self._timeout = deadline, timeout
        self._key = _auth.secret_bytes(secret)
        self._job = _handshake.job_id_bytes(job_id)
        self._peers: Dict[int, socket.socket] = {}
        self._root: Optional[socket.socket] = None
        if rank == 0:
            self._accept_all()
        else:
            self._dial()

    # -- the communicator -----------------------------------------------------------------
    def Get_rank(self) -> int:  # noqa: N802 (the mpi4py spelling start_job uses)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def bcast_json(self, obj: Any, root: int = 0) -> Any:
        assert root == 0
        if self.rank == 0:
            for r in sorted(self._peers):
                self._send(self._peers[r], obj, r)
            return obj
        return self._recv(self._root, 0)

    def allgather_json(self, obj: Any) -> List[Any]:
        if self.rank == 0:
            every = [obj] + [self._recv(self._peers[r], r) for r in range(1, self.size)]
            for r in range(1, self.size):
                self._send(self._peers[r], every, r)
            return every
        self._send(self._root, obj, 0)
        return self._recv(self._root, 0)

    def close(self) -> None:
        for sock in list(self._peers.values()) + ([self._root] if self._root else []):
            try:
                sock.close()
            except OSError:
                pass
        self._peers.clear()
        self._root = None

    # -- connecting -------------------------------------------------------------------------
    def _accept_all(self) -> None:
        host, port = split_address(self.addr, any_port=self._announce is not None)
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("::" if ":" in host else "0.0.0.0", port))
        except OSError as exc:
            raise BootstrapError(f"ddl.init: rank 0 cannot listen on port {port} of "
                                 f"DDL_RENDEZVOUS_ADDR={self.addr}: {exc}", rank=0) from None
        listener.listen(min(self.size, 1024))
        try:
            if self._announce is not None:
                port = listener.getsockname()[1]
                self.addr = f"{host}:{port}"
                self._announce(port)
            while len(self._peers) < self.size - 1:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in range(1, self.size) if r not in self._peers]
                    raise DDLTimeoutError(
                        f"ddl.init: rank 0 waited {self._timeout:g} s (DDL_START_TIMEOUT) on "
                        f"{self.addr} for ranks {missing} of {self.size}; start every rank "
                        f"with the same DDL_SIZE, DDL_JOB_SECRET and DDL_RENDEZVOUS_ADDR",
                        op="init", timeout=self._timeout)
                listener.settimeout(min(remaining, 1.0))
                try:
                    sock, peer = listener.accept()
                except socket.timeout:
                    continue
                self._admit(sock, f"{peer[0]}:{peer[1]}")
        finally:
            listener.close()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """Run the server side of the handshake on ``sock``; keep it if the client proves
        itself as a rank not yet seen, else close it (a stranger costs one header)."""
        side = _handshake.ServerSide(self._key, self._job, self.size, self.size + 1, peer)
        deadline = min(self._deadline, time.monotonic() + 10.0)
        try:
            while side.need:
                data = _handshake._recv_exact(sock, side.need, deadline, peer, "a handshake")
                try:
                    reply = side.received(data)
                except HandshakeError:
                    if side.refusal:
                        sock.sendall(side.refusal)
                    raise
                sock.sendall(reply)
        except (HandshakeError, OSError):
            sock.close()
            return
        rank = side.client_rank
        if rank == 0 or rank in self._peers:
            sock.close()  # rank 0 is this process; a second connection of a rank is refused
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[rank] = sock

    def _dial(self) -> None:
        host, port = split_address(self.addr)
        last = ""
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise DDLTimeoutError(
                    f"ddl.init: rank {self.rank} could not join rank 0 at "
                    f"DDL_RENDEZVOUS_ADDR={self.addr} within {self._timeout:g} s "
                    f"(DDL_START_TIMEOUT): {last or 'no answer'}", op="init",
                    timeout=self._timeout)
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
            except OSError as exc:  # rank 0 not up yet (or its name not yet resolvable)
                last = str(exc)
                time.sleep(min(_RETRY_S, max(0.0, remaining)))
                continue
            try:
                _handshake.client(sock, self._key, self._job, self.rank, self.size,
                                  self._deadline, self.addr)
            except HandshakeError as exc:
                sock.close()
                if exc.connection_lost:
                    last = str(exc)
                    time.sleep(_RETRY_S)
                    continue
                raise BootstrapError(
                    f"ddl.init: rank 0 at DDL_RENDEZVOUS_ADDR={self.addr} refused rank "
                    f"{self.rank}: the two have different DDL_JOB_SECRET (or DDL_JOB_ID) "
                    f"values, or different ddl versions; give every rank the same secret",
                    rank=self.rank) from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._root = sock
            return

    # -- messages -------------------------------------------------------------------------
    def _send(self, sock: socket.socket, obj: Any, to: int) -> None:
        data = json.dumps(obj).encode()
        try:
            sock.settimeout(max(0.001, self._deadline - time.monotonic()))
            sock.sendall(_LEN.pack(len(data)) + data)
        except OSError as exc:
            raise BootstrapError(f"ddl.init: rank {self.rank} lost rank {to} during start-up "
                                 f"({exc})", rank=to) from None

    def _recv(self, sock: socket.socket, frm: int) -> Any:
        what = f"rank {frm}'s start-up message"
        try:
            (n,) = _LEN.unpack(_handshake._recv_exact(sock, _LEN.size, self._deadline,
                                                      f"rank {frm}", what))
            if n > MAX_MESSAGE:
                raise BootstrapError(f"ddl.init: rank {frm} sent a {n}-byte start-up message "
                                     f"(at most {MAX_MESSAGE})", rank=frm)
            data = _handshake._recv_exact(sock, n, self._deadline, f"rank {frm}", what)
        except HandshakeError as exc:
            raise BootstrapError(f"ddl.init: rank {self.rank} lost rank {frm} during start-up "
                                 f"({exc})", rank=frm) from None
        return json.loads(data.decode())
