"""Registration: every rank announces itself once; all get the peer list together.

:meth:`Rendezvous.register` validates the request, records it and blocks until every
rank of the job registered, the start deadline passed, the caller went away or the
rendezvous was closed. It raises :class:`RegisterError` with a gRPC status code name and
a message naming the ranks involved. A rank lost before the rendezvous completed fails
it (:meth:`Rendezvous.fail`): every waiting and later caller gets a response carrying
only that error.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Set

from ddl.v1 import coordinator_pb2 as pb

from .topology import compute_topology
from .validation import clip

_POLL_S = 0.1  # how often a blocked register re-checks its caller and the deadline


class RegisterError(Exception):
    """A refused or failed registration; ``code`` is a ``grpc.StatusCode`` name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
        self.missing: List[int] = []  # DEADLINE_EXCEEDED: the ranks never registered

    @classmethod
    def timed_out(cls, ranks: List[int], code: str, message: str) -> "RegisterError":
        err = cls(code, message)
        err.missing = list(ranks)
        return err


class Rendezvous:
    """Registration table of one job of ``size`` ranks, complete by ``deadline``."""

    def __init__(self, job_id: str, size: int, start_timeout: float,
                 fusion_threshold: int, clock: Callable[[], float] = time.monotonic,
                 cache_capacity: int = 0):
        self.job_id = job_id
        self.size = size
        self.start_timeout = start_timeout
        self.deadline = clock() + start_timeout
        self._fusion_threshold = fusion_threshold
        self._cache_capacity = cache_capacity
        self._clock = clock
        self._cond = threading.Condition()
        self._peers: Dict[int, pb.RegisterRequest] = {}
        self._closed = False
        self._error: Optional[pb.Error] = None
        self._told: Set[int] = set()  # ranks answered with the error after the failure
        self.completed_at: Optional[float] = None  # when the last rank registered

    # -- queries -----------------------------------------------------------------------
    def registered(self) -> int:
        with self._cond:
            return len(self._peers)

    def is_registered(self, rank: int) -> bool:
        with self._cond:
            return rank in self._peers

    def complete(self) -> bool:
        with self._cond:
            return len(self._peers) == self.size

    def missing(self) -> List[int]:
        with self._cond:
            return [r for r in range(self.size) if r not in self._peers]

    def request(self, rank: int) -> Optional[pb.RegisterRequest]:
        """What ``rank`` registered with, or None."""
        with self._cond:
            return self._peers.get(rank)

    def unanswered(self) -> List[int]:
        """Ranks that have neither registered nor been told that the rendezvous failed."""
        with self._cond:
            return [r for r in range(self.size) if r not in self._peers and r not in self._told]

    def failed(self) -> bool:
        with self._cond:
            return self._error is not None

    def fail(self, err: pb.Error) -> None:
        """End the rendezvous with ``err`` (the first call wins): blocked and later
        :meth:`register` calls answer with it."""
        with self._cond:
            if self._error is None and self.completed_at is None:
                self._error = err
            self._cond.notify_all()

    def peers(self) -> List[pb.PeerInfo]:
        """Peer infos of the registered ranks, by rank."""
        with self._cond:
            return [pb.PeerInfo(rank=r, hostname=q.hostname, pid=q.pid,
                                data_address=q.data_address, cycle_address=q.cycle_address)
                    for r, q in sorted(self._peers.items())]

    def timed_out(self) -> bool:
        """The deadline passed before every rank registered."""
        return (not self.complete() and self._error is None
                and self._clock() >= self.deadline)

    def close(self) -> None:
        """Wake every blocked :meth:`register`; they fail with UNAVAILABLE."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- register ----------------------------------------------------------------------
    def _check(self, req: pb.RegisterRequest) -> None:
        if req.job_id != self.job_id:
            raise RegisterError("INVALID_ARGUMENT",
                                f"register: rank {req.rank} sent job id {clip(req.job_id)!r}, but "
                                f"this coordinator serves job {self.job_id!r}")
        if req.size != self.size:
            raise RegisterError("INVALID_ARGUMENT",
                                f"register: rank {req.rank} expects job size {req.size}, but "
                                f"the job has size {self.size}")
        if not 0 <= req.rank < self.size:
            raise RegisterError("INVALID_ARGUMENT",
                                f"register: rank {req.rank} is out of range [0, {self.size})")
        other = self._peers.get(req.rank)
        if other is not None:
            raise RegisterError(
                "INVALID_ARGUMENT",
                f"register: rank {req.rank} is already registered by host "
                f"{clip(other.hostname)} pid {other.pid}; this request came from host "
                f"{clip(req.hostname)} pid {req.pid}")

    def register(self, req: pb.RegisterRequest,
                 is_active: Callable[[], bool] = lambda: True,
                 caller_deadline: Optional[float] = None) -> pb.RegisterResponse:
        """Record ``req`` and block until the rendezvous completes; see the module doc."""
        with self._cond:
            if self._closed:
                raise RegisterError("UNAVAILABLE", "register: the coordinator is shutting down")
            if self._error is not None:
                if 0 <= req.rank < self.size:
                    self._told.add(req.rank)
                return pb.RegisterResponse(error=self._error)
            self._check(req)
            self._peers[req.rank] = req
            if len(self._peers) == self.size and self.completed_at is None:
                self.completed_at = self._clock()
            self._cond.notify_all()
            while len(self._peers) < self.size:
                now = self._clock()
                if self._error is not None:
                    return pb.RegisterResponse(error=self._error)
                if self._closed:
                    raise RegisterError("UNAVAILABLE",
                                        "register: the coordinator is shutting down")
                if now >= self.deadline:
                    missing = [r for r in range(self.size) if r not in self._peers]
                    raise RegisterError.timed_out(missing,
                        "DEADLINE_EXCEEDED",
                        f"register: rendezvous timed out after {self.start_timeout:g} s: "
                        f"{len(self._peers)} of {self.size} ranks registered, missing ranks "
                        f"{missing}; check that every worker started (DDL_START_TIMEOUT / "
                        f"--start-timeout)")
                if caller_deadline is not None and now >= caller_deadline:
                    raise RegisterError("DEADLINE_EXCEEDED",
                                        f"register: rank {req.rank}'s own deadline passed "
                                        f"before every rank registered")
                if not is_active():
                    raise RegisterError("CANCELLED", f"register: rank {req.rank} went away "
                                                     f"before the rendezvous completed")
                self._cond.wait(min(_POLL_S, self.deadline - now))
            hosts = [self._peers[r].hostname for r in range(self.size)]
            peers = [pb.PeerInfo(rank=r, hostname=q.hostname, pid=q.pid,
                                 data_address=q.data_address, cycle_address=q.cycle_address)
                     for r, q in sorted(self._peers.items())]
        topo = compute_topology(hosts)[req.rank]
        return pb.RegisterResponse(
            peers=peers, local_rank=topo.local_rank, local_size=topo.local_size,
            cross_rank=topo.cross_rank, cross_size=topo.cross_size,
            is_homogeneous=topo.is_homogeneous,
            fusion_threshold_bytes=self._fusion_threshold,
            cache_capacity=self._cache_capacity)
