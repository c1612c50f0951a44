"""Limits on connections that have not proven they belong to the job, for every listener.

Every listener of a job (each rank's data-plane and response-cache TCP ports, the
coordinators' gRPC sockets and the leader's peer port) closes a connection that has not
authenticated within :data:`UNAUTHENTICATED_DEADLINE_S`. The TCP listeners also bound how
many connections may wait at once (:func:`pending_cap`), evicting the oldest, so that a
flood of idle connections costs file descriptors only, and never keeps a rank out.
A process that listens raises its soft ``RLIMIT_NOFILE`` to the hard limit first
(:func:`raise_open_files_limit`), so that such a flood does not exhaust its descriptors.
"""

from __future__ import annotations

import ipaddress

try:
    import resource
except ImportError:  # pragma: no cover - not on Linux/macOS
    resource = None  # type: ignore[assignment]

UNAUTHENTICATED_DEADLINE_S = 5.0
MAX_PENDING = 4096        # pending handshakes per listener, at most
MIN_PENDING = 64          # ... and at least, however low the descriptor limit
PER_SOURCE_SHARE = 8      # one non-loopback address may hold 1/8 of them

_FALLBACK_NOFILE = 1024
_UNLIMITED = 1 << 20
_raised = False


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit where allowed (tried once per
    process); returns the soft limit in force."""
    global _raised
    if resource is None:
        return _FALLBACK_NOFILE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not _raised:
        _raised = True
        target = _UNLIMITED if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    return _UNLIMITED if soft == resource.RLIM_INFINITY else soft


def pending_cap() -> int:
    """How many connections one listener lets wait for their handshake: an eighth of the
    descriptor limit (a rank has two listeners), between MIN_PENDING and MAX_PENDING."""
    return max(MIN_PENDING, min(MAX_PENDING, raise_open_files_limit() // 8))


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and their IPv4-mapped forms (every local process)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
