"""Liveness by the transport: HTTP/2 keepalive pings on every control connection.

Every gRPC connection of a job (a worker and its coordinator, a coordinator and the
leader) pings the other side every ``interval`` seconds (``DDL_KEEPALIVE_INTERVAL_SECONDS``),
both ways: the client through its channel, the server through its own keepalive. A
ping is answered by gRPC's C core on its own threads, which need neither Python nor the
GIL, so a process busy in a pure-Python loop, a long NumPy call, a C call that holds the
GIL, or a garbage-collection pause still answers. A process that is stopped (SIGSTOP, a
debugger, a hung host) or cut off does not: after ``timeout`` seconds
(``DDL_KEEPALIVE_TIMEOUT_SECONDS``) the other side closes the connection, its streams
fail, and it reports the loss with :func:`cause`. A freeze is thus noticed within
``max(interval, 1 s) + timeout`` seconds (2.5 s by default): grpcio 1.85's clients
were measured to ping once a second at most, whatever the interval; its servers ping at
the interval.

Measured with grpcio 1.85 (see tests/test_liveness.py): ``grpc.keepalive_timeout_ms``
alone did not close the connection to a stopped peer within 10 s; the ping timeout of
the HTTP/2 transport (``grpc.http2.ping_timeout_ms``) does, so both are set. Servers
accept pings this frequent (``min_recv_ping_interval_without_data_ms``, no strikes),
and pings flow on idle connections (``permit_without_calls``, no limit on pings
without data).

The heartbeat messages of the control streams (``DDL_HEARTBEAT_INTERVAL_SECONDS``,
``DDL_LIVENESS_TIMEOUT_SECONDS``) stay as a slower, application-level check: they come
from Python threads, so they also catch a process whose connection is fine but whose
Python has not run for a minute.
"""

from __future__ import annotations

from typing import List, Tuple

Options = List[Tuple[str, int]]


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


def channel_options(interval: float, timeout: float) -> Options:
    """Channel arguments of a client; none when ``timeout`` is 0 (keepalive off)."""
    if timeout <= 0:
        return []
    return [("grpc.keepalive_time_ms", _ms(interval)),
            ("grpc.keepalive_timeout_ms", _ms(timeout)),
            ("grpc.http2.ping_timeout_ms", _ms(timeout)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(interval: float, timeout: float) -> Options:
    """Arguments of a server: it pings its clients as they ping it, and accepts their
    pings however often they come (a client's ping is never a strike). With ``timeout``
    0 it sends no pings but still accepts them."""
    accept = [("grpc.http2.min_recv_ping_interval_without_data_ms", _ms(interval) // 2),
              ("grpc.http2.max_ping_strikes", 0)]
    return channel_options(interval, timeout) + accept


def cause(timeout: float) -> str:
    """Why a process whose connection failed its keepalive counts as lost."""
    return f"frozen or unreachable: no keepalive answer within {timeout:g} s"


def detection_bound(interval: float, timeout: float) -> float:
    """Seconds within which keepalive notices a stopped peer (0: keepalive is off)."""
    return max(interval, 1.0) + timeout if timeout > 0 else 0.0


def silence(interval: float, timeout: float, liveness: float) -> str:
    """What a peer silent past the ``liveness`` timeout most likely is. Only when keepalive
    would have noticed a frozen process first does silence mean its Python is hung while
    its connection answers pings; otherwise it may be either."""
    bound = detection_bound(interval, timeout)
    if bound and liveness > bound:
        return "hung: its connection answers keepalive pings, but its Python sends nothing"
    return "frozen, hung or unreachable"


def is_keepalive_failure(details: str) -> bool:
    """Whether a client-side status ``details`` text says the keepalive ping went
    unanswered (grpcio says "Stream removed (ping timeout)" or "keepalive watchdog
    timeout")."""
    text = (details or "").lower()
    return "ping timeout" in text or "keepalive" in text
