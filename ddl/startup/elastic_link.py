"""A worker's link to the elastic launcher (``ddlrun --min-np/--max-np``).

ddlrun starts each worker of an elastic job with ``DDL_ELASTIC_ADDR`` (``host:port`` of
its rendezvous), ``DDL_ELASTIC_WORKER`` (the worker's index: ddlrun numbers every process
it starts, and never reuses a number) and the job secret. The worker dials once, proves
the secret with the data plane's handshake (:mod:`ddl.dataplane.transports._handshake`;
its index is the client identity, :data:`DRIVER_IDENTITY` the server's), and keeps the
connection for its whole life. Over it, JSON requests, one at a time, each answered:

- ``join``: "put me in the next world" (with the ranks this worker saw lost and why);
  answered, once every live worker asked, with ``assign`` (generation, rank, size, the
  generation's job id and membership version), ``exit`` (ddlrun released this worker:
  its host left, or the job finished) or ``error`` (fewer than ``--min-np`` remain);
- ``allgather``: the few messages of the world's bootstrap
  (:func:`ddl.startup.bootstrap.start_job`), gathered by ddlrun;
- ``poll``: whether ddlrun added or released workers since this world formed (rank 0
  asks at each ``State.commit()``).

Every wait is bounded; a launcher that died closes the connection, which every waiting
worker sees at once.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, List, Optional

from ddl.core import auth as _auth
from ddl.core import json_link
from ddl.core.errors import BootstrapError, DDLTimeoutError, HandshakeError
from ddl.dataplane.transports import _handshake

DRIVER_IDENTITY = json_link.ELASTIC_IDENTITY
_RETRY_S = 0.2


def handshake_job(job_id: str) -> bytes:
    """The handshake's job field on the elastic rendezvous (not any generation's)."""
    return _handshake.job_id_bytes(json_link.elastic_job_key(job_id))


class DriverLink:
    """The connection to ddlrun's elastic rendezvous (see the module doc)."""

    def __init__(self, addr: str, secret: str, job_id: str, worker: int, timeout: float):
        self.addr, self.worker = addr, worker
        self._lock = threading.Lock()
        self._sock = self._dial(addr, _auth.secret_bytes(secret), handshake_job(job_id),
                                worker, time.monotonic() + timeout, timeout)

    @staticmethod
    def _dial(addr: str, key: bytes, job: bytes, worker: int, deadline: float,
              timeout: float) -> socket.socket:
        host, _, port = addr.rpartition(":")
        last = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DDLTimeoutError(f"ddl.init: elastic worker {worker} could not reach "
                                      f"ddlrun at DDL_ELASTIC_ADDR={addr} within {timeout:g} s "
                                      f"(DDL_START_TIMEOUT): {last or 'no answer'}", op="init",
                                      timeout=timeout)
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)),
                                                timeout=min(remaining, 5.0))
            except OSError as exc:
                last = str(exc)
                time.sleep(min(_RETRY_S, max(0.0, remaining)))
                continue
            try:
                _handshake.client(sock, key, job, worker, DRIVER_IDENTITY, deadline, addr)
            except HandshakeError as exc:
                sock.close()
                raise BootstrapError(f"ddl.init: ddlrun's elastic rendezvous at {addr} "
                                     f"refused worker {worker}: {exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def request(self, message: dict, timeout: float, what: str) -> dict:
        """Send ``message`` and wait (at most ``timeout`` s) for its answer."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._sock is None:
                raise BootstrapError(f"{what}: the link to ddlrun is closed")
            try:
                json_link.send(self._sock, message, deadline)
                reply = json_link.recv(self._sock, deadline)
            except json_link.LinkTimeout:
                raise DDLTimeoutError(f"{what}: ddlrun (elastic rendezvous {self.addr}) did "
                                      f"not answer within {timeout:g} s", op="elastic",
                                      timeout=timeout) from None
            except json_link.LinkClosed as exc:
                self.close()
                raise BootstrapError(f"{what}: the connection to ddlrun (elastic rendezvous "
                                     f"{self.addr}) broke: {exc}; the launcher ended") from None
        if not isinstance(reply, dict) or "op" not in reply:
            raise BootstrapError(f"{what}: ddlrun sent a malformed answer: {reply!r}"[:300])
        return reply

    @property
    def closed(self) -> bool:
        """The connection broke (ddlrun is gone): no world can form any more."""
        return self._sock is None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class DriverComm:
    """One world's bootstrap communicator through ddlrun (``allgather_json`` and
    ``bcast_json``, as :func:`ddl.startup.bootstrap.start_job` needs), collective over
    the world's workers."""

    def __init__(self, link: DriverLink, generation: int, rank: int, timeout: float):
        self._link, self._generation, self.rank = link, generation, rank
        self._timeout, self._seq = timeout, 0

    def allgather_json(self, obj: Any) -> List[Any]:
        self._seq += 1
        reply = self._link.request({"op": "allgather", "generation": self._generation,
                                    "seq": self._seq, "value": obj}, self._timeout,
                                   f"ddl.init (world {self._generation}, rank {self.rank})")
        if reply["op"] != "values":
            raise BootstrapError(f"ddl.init: world {self._generation} could not form: "
                                 f"{reply.get('message', reply)}", rank=self.rank)
        return list(reply["values"])

    def bcast_json(self, obj: Any, root: int) -> Any:
        return self.allgather_json(obj if self.rank == root else None)[root]


_link: Optional[DriverLink] = None
world: Optional[dict] = None  # the latest ``assign``: generation, rank, size, job_id, version
_failure: dict = {"lost": [], "reason": ""}


def note_failure(lost: List[int], reason: str) -> None:
    """What ended this worker's world, for its next ``join`` (ddlrun stops waiting for
    the ranks this worker saw lost, and kills them if they still run)."""
    _failure["lost"], _failure["reason"] = list(lost), reason[:500]


def take_failure() -> tuple:
    lost, reason = _failure["lost"], _failure["reason"]
    _failure["lost"], _failure["reason"] = [], ""
    return lost, reason


def link(addr: str, secret: str, job_id: str, worker: int, timeout: float) -> DriverLink:
    """This process's link to ddlrun, dialled on first use and kept."""
    global _link
    if _link is None:
        _link = DriverLink(addr, secret, job_id, worker, timeout)
    return _link


def current() -> Optional[DriverLink]:
    """The link, when this process is a worker of an elastic job that has joined."""
    return _link


def _forget_in_child() -> None:
    global _link, world
    _link, world = None, None  # a forked child (a data loader) is not a worker


import os  # noqa: E402

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
