"""The data-plane handshake: a fixed header, then HMAC proofs over two fresh nonces, the
client's first.

Wire format (all integers big-endian)::

    client -> server  header (50 bytes): b"DDL1", u16 version=2, u32 client rank,
                      8-byte job id, 32-byte nonce_c
    server -> client  32-byte nonce_s
    client -> server  32-byte mac(key, b"cli", job, c, s, nonce_c, nonce_s)
    server -> client  32-byte mac(key, b"srv", job, c, s, nonce_c, nonce_s)

``c`` and ``s`` are the client's and server's ranks as u32. The lower rank of a pair is
the client.

Who learns what: the server reads nothing but the fixed header and then the client's
32-byte proof, and allocates nothing that depends on what the client sent. It answers a
header with nothing but a fresh random nonce, so a listener proves nothing about the
secret to a peer that has not proven itself first; its own proof covers both fresh nonces,
so neither proof can be replayed on another connection. A header of another job, a rank
that may not dial this one, another protocol version, or a wrong client proof get one
refusal byte before the server hangs up (so that the client can tell a refusal from a
peer that died, which sends nothing); a header without the magic gets nothing.

The server side is a state machine without I/O (:class:`ServerSide`), so that one
acceptor thread can serve many pending handshakes at once
(:mod:`ddl.dataplane.transports._tcp_accept`); the client side runs on a blocking socket
in the dialing rank's own thread.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from ddl.core.auth import mac
from ddl.core.errors import HandshakeError

MAGIC = b"DDL1"
VERSION = 2
HEADER = struct.Struct("!4sHI8s32s")
NONCE_BYTES = 32
MAC_BYTES = 32
REFUSAL = b"\0"


def job_id_bytes(job_id: str) -> bytes:
    """The 8-byte job id on the wire: ``bytes.fromhex(job_id)`` padded/truncated to 8."""
    try:
        raw = bytes.fromhex(job_id)
    except ValueError:
        raw = hashlib.sha256(job_id.encode()).digest()
    return raw[:8].ljust(8, b"\0")


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def _proofs(key: bytes, job: bytes, client_rank: int, server_rank: int, nonce_c: bytes,
            nonce_s: bytes):
    parts = (job, _u32(client_rank), _u32(server_rank), nonce_c, nonce_s)
    return mac(key, b"srv", *parts), mac(key, b"cli", *parts)


def _recv_exact(sock: socket.socket, n: int, deadline: float, addr: str, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HandshakeError(f"handshake with {addr} timed out waiting for {what} "
                                 f"({got} of {n} bytes)", peer=addr)
        sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            continue
        except OSError as exc:
            raise HandshakeError(f"handshake with {addr} failed reading {what}: {exc}",
                                 peer=addr,
                                 connection_lost=got == 0) from exc
        if k == 0:
            # a refusing server sends one byte before it hangs up; a dead one sends none
            raise HandshakeError(f"{addr} closed the connection during the handshake, "
                                 f"before sending {what} ({got} of {n} bytes)", peer=addr,
                                 connection_lost=got == 0)
        got += k
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float, addr: str, what: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise HandshakeError(f"handshake with {addr} timed out before sending {what}", peer=addr)
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except OSError as exc:
        raise HandshakeError(f"handshake with {addr} failed sending {what}: {exc}",
                             peer=addr, connection_lost=True) from exc


def client(sock: socket.socket, key: bytes, job: bytes, client_rank: int, server_rank: int,
           deadline: float, addr: str) -> None:
    """Run the client side on a connected blocking socket; ``HandshakeError`` on failure."""
    nonce_c = os.urandom(NONCE_BYTES)
    who = f"rank {server_rank} ({addr})"
    _send_all(sock, HEADER.pack(MAGIC, VERSION, client_rank, job, nonce_c), deadline, who,
              "the header")
    try:
        nonce_s = _recv_exact(sock, NONCE_BYTES, deadline, who, "its nonce")
    except HandshakeError as exc:
        raise HandshakeError(
            f"rank {server_rank} ({addr}) refused the data-plane handshake from rank "
            f"{client_rank} ({exc}); check that both processes belong to the same job "
            f"(job id and DDL_JOB_SECRET) and run the same ddl version", peer=addr,
            connection_lost=exc.connection_lost) from exc
    srv, cli = _proofs(key, job, client_rank, server_rank, nonce_c, nonce_s)
    _send_all(sock, cli, deadline, who, "the client proof")
    try:
        server_proof = _recv_exact(sock, MAC_BYTES, deadline, who, "its proof")
    except HandshakeError as exc:
        raise HandshakeError(
            f"rank {server_rank} ({addr}) refused the proof of rank {client_rank} ({exc}); "
            f"either this process or the listener has a different DDL_JOB_SECRET",
            peer=addr, connection_lost=exc.connection_lost) from exc
    if not hmac.compare_digest(srv, server_proof):
        raise HandshakeError(
            f"rank {server_rank} ({addr}) failed to prove it knows the job secret; "
            f"either this process or the listener has a different DDL_JOB_SECRET", peer=addr)


class ServerSide:
    """The server's side of one handshake, without I/O.

    :attr:`need` is how many bytes to read next (0 once done). Pass exactly that many to
    :meth:`received` and send what it returns. On a refusal it raises
    :class:`HandshakeError`; then send :attr:`refusal` (empty or one byte) and close.
    Once :attr:`need` is 0, :attr:`client_rank` is the proven rank of the client.
    """

    __slots__ = ("_key", "_job", "_rank", "_size", "_addr", "_cli", "_srv", "need",
                 "client_rank", "refusal")

    def __init__(self, key: bytes, job: bytes, server_rank: int, size: int, addr: str):
        self._key, self._job, self._rank, self._size, self._addr = (key, job, server_rank,
                                                                   size, addr)
        self._cli = self._srv = b""
        self.need = HEADER.size
        self.client_rank = -1
        self.refusal = b""

    @property
    def started(self) -> bool:
        """The client sent a well-formed header of this job (a rank may be behind it)."""
        return bool(self._cli)

    def received(self, data: bytes) -> bytes:
        if len(data) != self.need or not self.need:
            raise ValueError(f"ServerSide.received: expected {self.need} bytes, "
                             f"got {len(data)}")
        if not self._cli:
            return self._header(data)
        return self._proof(data)

    def _refuse(self, message: str, reply: bytes = REFUSAL) -> HandshakeError:
        self.need = 0
        self.refusal = reply
        return HandshakeError(message, peer=self._addr)

    def _header(self, data: bytes) -> bytes:
        addr = self._addr
        magic, version, client_rank, their_job, nonce_c = HEADER.unpack(data)
        if magic != MAGIC:
            raise self._refuse(f"connection from {addr} is not a ddl data-plane client "
                               f"(bad magic {magic!r})", reply=b"")
        if version != VERSION:
            raise self._refuse(f"connection from {addr} speaks data-plane protocol version "
                               f"{version}; this process speaks {VERSION}")
        if their_job != self._job:
            raise self._refuse(f"connection from {addr} belongs to job {their_job.hex()}, "
                               f"not this job {self._job.hex()}")
        if not 0 <= client_rank < min(self._rank, self._size):
            raise self._refuse(f"connection from {addr} claims rank {client_rank}; only "
                               f"ranks 0..{self._rank - 1} dial rank {self._rank}")
        nonce_s = os.urandom(NONCE_BYTES)
        self._srv, self._cli = _proofs(self._key, self._job, client_rank, self._rank, nonce_c,
                                       nonce_s)
        self.client_rank = client_rank
        self.need = MAC_BYTES
        return nonce_s

    def _proof(self, data: bytes) -> bytes:
        if not hmac.compare_digest(self._cli, data):
            raise self._refuse(f"connection from {self._addr} claiming rank "
                               f"{self.client_rank} failed to prove it knows the job secret")
        self.need = 0
        return self._srv

