"""The elastic rendezvous's connections, the part of
:class:`~ddl.launcher.elastic.driver.ElasticJob` that talks to its workers.

One TCP connection per worker, accepted on ddlrun's listener: the data plane's HMAC
handshake (:mod:`ddl.dataplane.transports._handshake`, the worker's index as the client's
identity) comes before anything else is read; then length-prefixed JSON frames
(:mod:`ddl.core.json_link`), no pickle. Every connection carries TCP keepalive probes, so
a worker whose host is cut off or down is found within about
``2 + DDL_KEEPALIVE_TIMEOUT_SECONDS`` seconds. What arrives becomes an event on the job's
queue (``connected``, ``message``, ``closed``, ``unreachable``); the job's loop answers.
"""

from __future__ import annotations

import errno
import math
import socket
import threading
import time
from typing import Any

from ddl.core import auth as _auth
from ddl.core import json_link
from ddl.core.errors import HandshakeError
from ddl.dataplane.transports import _handshake

HANDSHAKE_S = 10.0


class RendezvousLinks:
    """Mixed into ElasticJob (uses its ``_listener``, ``_secret``, ``job_id``,
    ``_events``, ``_closing``, ``_link_timeout`` and ``_log``)."""

    def _accept(self) -> None:
        key = _auth.secret_bytes(self._secret)
        job = _handshake.job_id_bytes(json_link.elastic_job_key(self.job_id))
        while not self._closing.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, f"{peer[0]}:{peer[1]}", key, job),
                             daemon=True).start()

    def _admit(self, sock: socket.socket, peer: str, key: bytes, job: bytes) -> None:
        side = _handshake.ServerSide(key, job, json_link.ELASTIC_IDENTITY,
                                     json_link.ELASTIC_IDENTITY + 1, peer)
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            while side.need:
                data = _handshake._recv_exact(sock, side.need, deadline, peer, "a handshake")
                try:
                    reply = side.received(data)
                except HandshakeError as exc:
                    if side.refusal:
                        sock.sendall(side.refusal)
                    self._log(f"refused a connection to the elastic rendezvous: {exc}")
                    raise
                sock.sendall(reply)
        except (HandshakeError, OSError):
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._keepalive(sock)
        self._events.put(("connected", side.client_rank, sock))

    def _keepalive(self, sock: socket.socket) -> None:
        """TCP keepalive probes on a worker's link, answered by its host's kernel (so a
        frozen worker still answers): a host cut off or down fails the link within about
        ``2 + DDL_KEEPALIVE_TIMEOUT_SECONDS`` seconds (the kernel counts whole seconds)."""
        if self._link_timeout <= 0:
            return
        count = max(1, math.ceil(self._link_timeout))
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (1 + count) * 1000)
        except (AttributeError, OSError):
            pass  # not Linux: the link fails with TCP's own (minutes-long) timeouts

    def _read(self, w: Any, sock: socket.socket) -> None:
        while True:
            try:
                message = json_link.recv(sock)
            except (json_link.LinkClosed, json_link.LinkTimeout) as exc:
                cause = exc.__context__
                if getattr(cause, "errno", None) == errno.ETIMEDOUT:  # keepalive failed
                    self._events.put(("unreachable", w.index,
                                      f"no TCP keepalive answer within "
                                      f"{1 + max(1, math.ceil(self._link_timeout))} s"))
                self._events.put(("closed", w.index))
                return
            self._events.put(("message", w.index, message))

    def _reply(self, w: Any, message: dict) -> None:
        sock = w.sock
        if sock is None:
            return
        try:
            json_link.send(sock, message, time.monotonic() + 5.0)
        except (json_link.LinkClosed, json_link.LinkTimeout):
            w.sock = None
