"""Length-prefixed JSON messages on a connected socket, every read and write bounded by
a deadline (the elastic launcher and its workers speak this after the job's handshake).

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON; a frame
longer than :data:`MAX_MESSAGE` is refused before it is read. No pickle.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Optional

_LEN = struct.Struct("!I")
MAX_MESSAGE = 1 << 20
# The elastic rendezvous (ddlrun) in the data plane's handshake: its identity, above any
# worker index, and the job field it checks (derived, so no generation's id matches it).
ELASTIC_IDENTITY = 1 << 30


def elastic_job_key(job_id: str) -> str:
    """The hex job id that the elastic rendezvous's handshake uses for ``job_id``."""
    import hashlib
    return hashlib.sha256(b"ddl-elastic" + job_id.encode()).hexdigest()[:16]


class LinkClosed(ConnectionError):
    """The other end closed the connection, or it broke."""


class LinkTimeout(TimeoutError):
    """No whole frame arrived before the deadline."""


def send(sock: socket.socket, obj: Any, deadline: Optional[float] = None) -> None:
    """Write one frame; LinkClosed if the connection broke, LinkTimeout past ``deadline``."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    try:
        sock.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))
        sock.sendall(_LEN.pack(len(data)) + data)
    except socket.timeout:
        raise LinkTimeout("sending a message timed out") from None
    except OSError as exc:
        raise LinkClosed(str(exc)) from None


def _exact(sock: socket.socket, n: int, deadline: Optional[float]) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LinkTimeout(f"waited past the deadline for a message ({got} of {n} "
                                  f"bytes)")
            sock.settimeout(min(remaining, 1.0))
        else:
            sock.settimeout(None)
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout as exc:
            if exc.errno is None:  # our own timeout: check the deadline
                continue
            raise LinkClosed(str(exc)) from None  # ETIMEDOUT: TCP gave the peer up
        except OSError as exc:
            raise LinkClosed(str(exc)) from None
        if k == 0:
            raise LinkClosed("the other end closed the connection")
        got += k
    return bytes(buf)


def recv(sock: socket.socket, deadline: Optional[float] = None) -> Any:
    """Read one frame (see the module doc)."""
    (n,) = _LEN.unpack(_exact(sock, _LEN.size, deadline))
    if n > MAX_MESSAGE:
        raise LinkClosed(f"a {n}-byte message was refused (at most {MAX_MESSAGE})")
    try:
        return json.loads(_exact(sock, n, deadline).decode())
    except ValueError as exc:
        raise LinkClosed(f"a message was not JSON: {exc}") from None
