"""The data-plane handshake: a fixed header, then an HMAC challenge over two nonces.

Wire format (all integers big-endian)::

    client -> server  header (50 bytes): b"DDL1", u16 version=1, u32 client rank,
                      8-byte job id, 32-byte nonce_c
    server -> client  32-byte nonce_s, 32-byte mac(key, b"srv", job, c, s, nonce_c, nonce_s)
    client -> server  32-byte mac(key, b"cli", job, c, s, nonce_c, nonce_s)

``c`` and ``s`` are the client's and server's ranks as u32. The server reads nothing but
the fixed header before the client has proven it knows the job secret, and allocates
nothing that depends on what the client sent. The lower rank of a pair is the client.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from ddl._auth import mac
from ddl._errors import HandshakeError

MAGIC = b"DDL1"
VERSION = 1
HEADER = struct.Struct("!4sHI8s32s")
NONCE_BYTES = 32
MAC_BYTES = 32


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
                             peer=addr,
                                 connection_lost=True) from exc


def client(sock: socket.socket, key: bytes, job: bytes, client_rank: int, server_rank: int,
           deadline: float, addr: str) -> None:
    """Run the client side on a connected blocking socket; ``HandshakeError`` on failure."""
    nonce_c = os.urandom(NONCE_BYTES)
    who = f"rank {server_rank} ({addr})"
    _send_all(sock, HEADER.pack(MAGIC, VERSION, client_rank, job, nonce_c), deadline, who,
              "the header")
    try:
        reply = _recv_exact(sock, NONCE_BYTES + MAC_BYTES, deadline, who, "the server proof")
    except HandshakeError as exc:
        raise HandshakeError(
            f"rank {server_rank} ({addr}) refused the data-plane handshake from rank "
            f"{client_rank} ({exc}); check that both processes belong to the same job "
            f"(job id and DDL_JOB_SECRET)", peer=addr,
            connection_lost=exc.connection_lost) from exc
    nonce_s, server_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    srv, cli = _proofs(key, job, client_rank, server_rank, nonce_c, nonce_s)
    if not hmac.compare_digest(srv, server_proof):
        raise HandshakeError(
            f"rank {server_rank} ({addr}) failed to prove it knows the job secret; "
            f"either this process or the listener has a different DDL_JOB_SECRET", peer=addr)
    _send_all(sock, cli, deadline, who, "the client proof")


def _refuse(sock: socket.socket) -> None:
    """Answer a well-formed ddl header we refuse with one byte, so that the client can tell
    a refusal from a peer that died (which sends nothing). Garbage gets nothing."""
    try:
        sock.send(b"\0")
    except OSError:
        pass


def server(sock: socket.socket, key: bytes, job: bytes, server_rank: int, size: int,
           deadline: float, addr: str) -> int:
    """Run the server side on an accepted blocking socket; returns the client's rank."""
    header = _recv_exact(sock, HEADER.size, deadline, addr, "the header")
    magic, version, client_rank, their_job, nonce_c = HEADER.unpack(header)
    if magic != MAGIC:
        raise HandshakeError(f"connection from {addr} is not a ddl data-plane client "
                             f"(bad magic {magic!r})", peer=addr)
    if version != VERSION:
        raise HandshakeError(f"connection from {addr} speaks data-plane protocol version "
                             f"{version}; this process speaks {VERSION}", peer=addr)
    if their_job != job:
        _refuse(sock)
        raise HandshakeError(f"connection from {addr} belongs to job {their_job.hex()}, "
                             f"not this job {job.hex()}", peer=addr)
    if not 0 <= client_rank < min(server_rank, size):
        _refuse(sock)
        raise HandshakeError(f"connection from {addr} claims rank {client_rank}; only ranks "
                             f"0..{server_rank - 1} dial rank {server_rank}", peer=addr)
    nonce_s = os.urandom(NONCE_BYTES)
    srv, cli = _proofs(key, job, client_rank, server_rank, nonce_c, nonce_s)
    _send_all(sock, nonce_s + srv, deadline, addr, "the server proof")
    proof = _recv_exact(sock, MAC_BYTES, deadline, addr, "the client proof")
    if not hmac.compare_digest(cli, proof):
        raise HandshakeError(f"connection from {addr} claiming rank {client_rank} failed to "
                             f"prove it knows the job secret", peer=addr)
    return client_rank
