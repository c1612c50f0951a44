"""Server-side authentication: every call must carry the job's ``ddl-auth`` token.

The interceptor answers a call without the right token UNAUTHENTICATED before the
request is parsed (the refusing handler has no request deserializer), and logs refusals,
naming the caller's address, at most once per second so a flood cannot fill the log.

Connections that never make a call are closed by gRPC itself, through the server options
of :func:`unauthenticated_connection_options`.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import grpc

from ddl.core import limits as _limits
from ddl.core.auth import GRPC_METADATA_KEY, grpc_token

log = logging.getLogger("ddl.server")

REFUSAL = ("missing or invalid ddl-auth token: this coordinator only serves workers of "
           "its own job (check DDL_JOB_ID and DDL_JOB_SECRET)")


def unauthenticated_connection_options() -> List[Tuple[str, int]]:
    """gRPC server options that close a connection that has not authenticated within
    :data:`ddl.core.limits.UNAUTHENTICATED_DEADLINE_S`: one that has not finished the HTTP/2
    handshake (the client's SETTINGS frame) by then, and one with no call in progress for
    that long. A worker's or a relay's connection carries its long-lived stream, so it is
    never idle; a client that is idle between calls reconnects on its next call. (gRPC's
    ``grpc.max_allowed_incoming_connections`` is not used: it refuses new connections when
    full, which would let a flood keep the job's own ranks out.)"""
    deadline_ms = int(_limits.UNAUTHENTICATED_DEADLINE_S * 1000)
    return [("grpc.server_handshake_timeout_ms", deadline_ms),
            ("grpc.max_connection_idle_ms", deadline_ms)]


def _caller(context: grpc.ServicerContext) -> str:
    try:
        return context.peer() or "an unknown address"
    except Exception:  # noqa: BLE001 - only for the log line
        return "an unknown address"


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``ddl-auth`` metadata is not the job's token."""

    def __init__(self, secret_hex: str, job_id: str, log_interval_s: float = 1.0):
        self._token = grpc_token(secret_hex, job_id)
        self._log_interval_s = log_interval_s
        self._lock = threading.Lock()
        self._last_log = float("-inf")
        self._suppressed = 0
        self.refused = 0  # calls refused so far

    def _note_refusal(self, method: str, peer: str = "an unknown address") -> None:
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            if now - self._last_log < self._log_interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last_log = self._suppressed, 0, now
        extra = f" ({suppressed} more refused since the last report)" if suppressed else ""
        log.warning("refused an unauthenticated call to %s from %s%s", method, peer, extra)

    def _refusing(self, method: str, streaming: bool):
        """A handler that logs and refuses a call without reading its request."""
        def refuse_unary(request: Any, context: grpc.ServicerContext) -> Any:
            self._note_refusal(method, _caller(context))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        def refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
            self._note_refusal(method, _caller(context))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
            yield  # pragma: no cover - makes this a generator, as streaming handlers are

        return refuse_stream if streaming else refuse_unary

    def intercept_service(self, continuation: Callable[[Any], Optional[grpc.RpcMethodHandler]],
                          handler_call_details: grpc.HandlerCallDetails
                          ) -> Optional[grpc.RpcMethodHandler]:
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == GRPC_METADATA_KEY:
                presented = value if isinstance(value, str) else ""
        if hmac.compare_digest(presented.encode(), self._token.encode()):
            return continuation(handler_call_details)
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None:
            self._note_refusal(method)
            return None
        refuse = self._refusing(method, handler.response_streaming)
        if handler.response_streaming:
            if handler.request_streaming:
                return grpc.stream_stream_rpc_method_handler(
                    refuse, response_serializer=handler.response_serializer)
            return grpc.unary_stream_rpc_method_handler(
                refuse, response_serializer=handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                refuse, response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer)
