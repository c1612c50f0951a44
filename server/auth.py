"""Server-side authentication: every call must carry the job's ``ddl-auth`` token.

The interceptor answers a call without the right token UNAUTHENTICATED before the
request is parsed (the refusing handler has no request deserializer), and logs refusals
at most once per second so a flood cannot fill the log.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any, Callable, Optional

import grpc

from ddl._auth import GRPC_METADATA_KEY, grpc_token

log = logging.getLogger("ddl.server")

REFUSAL = ("missing or invalid ddl-auth token: this coordinator only serves workers of "
           "its own job (check DDL_JOB_ID and DDL_JOB_SECRET)")


def _refuse_unary(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    yield  # pragma: no cover - makes this a generator, as streaming handlers are


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``ddl-auth`` metadata is not the job's token."""

    def __init__(self, secret_hex: str, job_id: str, log_interval_s: float = 1.0):
        self._token = grpc_token(secret_hex, job_id)
        self._log_interval_s = log_interval_s
        self._lock = threading.Lock()
        self._last_log = float("-inf")
        self._suppressed = 0
        self.refused = 0  # calls refused so far

    def _note_refusal(self, method: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            if now - self._last_log < self._log_interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last_log = self._suppressed, 0, now
        extra = f" ({suppressed} more refused since the last report)" if suppressed else ""
        log.warning("refused an unauthenticated call to %s%s", method, extra)

    def intercept_service(self, continuation: Callable[[Any], Optional[grpc.RpcMethodHandler]],
                          handler_call_details: grpc.HandlerCallDetails
                          ) -> Optional[grpc.RpcMethodHandler]:
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == GRPC_METADATA_KEY:
                presented = value if isinstance(value, str) else ""
        if hmac.compare_digest(presented.encode(), self._token.encode()):
            return continuation(handler_call_details)
        self._note_refusal(handler_call_details.method)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.response_streaming:
            if handler.request_streaming:
                return grpc.stream_stream_rpc_method_handler(
                    _refuse_stream, response_serializer=handler.response_serializer)
            return grpc.unary_stream_rpc_method_handler(
                _refuse_stream, response_serializer=handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                _refuse_unary, response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _refuse_unary, response_serializer=handler.response_serializer)
