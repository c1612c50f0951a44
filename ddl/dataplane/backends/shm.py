"""The shared-memory backend: collectives whose members all run on this host.

:class:`ShmBackend` runs :mod:`ddl.dataplane.algorithms.shm_collectives` on a connected
:class:`~ddl.dataplane.transports.shm.ShmGroup` that :class:`ShmGroups` makes on first use, one per
member set, while every member executes the same response, so they all connect at the
same point of the global order. ``DDL_TRANSPORT`` forces the choice: ``auto`` (shared
memory when it can), ``shm`` (an error where it cannot), ``tcp`` (never).
``DDL_SHM_ALLREDUCE_ALGORITHM`` picks the allreduce algorithm.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ddl.core.errors import ConfigError
from ddl.dataplane.backends.base import Backend
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb

_SLOT_BYTES = 1 << 20  # per rank and bank: the chunk one rank moves per round


class ShmGroups:
    """Shared-memory groups of this rank, by member ranks."""

    def __init__(self, mode: str, job_id: str, secret: bytes, rank: int,
                 hosts: Mapping[int, str], abort_check: Callable[[], None],
                 tag_prefix: str = "g"):
        self.mode = mode
        self._tag_prefix = tag_prefix  # a second set of groups (the cycles') gets its own
        self._job_id = job_id
        self._secret = secret
        self._rank = rank
        self._hosts = dict(hosts)
        self._abort_check = abort_check
        self._groups: Dict[Tuple[int, ...], object] = {}
        self._lock = threading.Lock()
        self._available: Optional[bool] = None

    def _shm_possible(self) -> bool:
        if self._available is None:
            from ddl.dataplane.transports import shm
            self._available = shm.available()
        return self._available

    def usable(self) -> bool:
        """Whether shared memory may carry anything (DDL_TRANSPORT, the machine)."""
        return self.mode != "tcp" and self._shm_possible()

    def supports(self, group: Group) -> bool:
        """Whether ``group``'s collectives run in shared memory: two or more members, all
        on this host. Raises ConfigError where DDL_TRANSPORT=shm cannot be honoured."""
        if self.mode == "tcp" or group.size < 2:
            return False
        host = self._hosts.get(self._rank)
        if any(self._hosts.get(r) != host for r in group.ranks):
            if self.mode == "shm" and len(set(self._hosts.values())) == 1:
                raise ConfigError("DDL_TRANSPORT=shm but the members of this collective are "
                                  "on different hosts", variable="DDL_TRANSPORT", value="shm")
            return False
        if not self._shm_possible():
            if self.mode == "shm":
                raise ConfigError("DDL_TRANSPORT=shm but shared memory is not available on "
                                  "this machine (Linux futexes and /dev/shm are needed)",
                                  variable="DDL_TRANSPORT", value="shm")
            return False
        return True

    def get(self, group: Group, deadline: float):
        """The connected shared-memory group for ``group`` (one :meth:`supports`)."""
        host = self._hosts.get(self._rank)
        with self._lock:
            found = self._groups.get(group.ranks)
        if found is not None:
            return found
        from ddl.dataplane.transports.shm import ShmGroup

        tag = self._tag_prefix + hashlib.sha256(repr(group.ranks).encode()).hexdigest()[:16]
        made = ShmGroup(self._job_id, self._secret, host or "", group.index, group.size,
                        _SLOT_BYTES, self._abort_check, tag=tag,
                        ranks=group.ranks).connect(deadline)
        with self._lock:
            self._groups[group.ranks] = made
        return made

    def close(self) -> None:
        """Leave every group (idempotent)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for g in groups:
            g.close()  # type: ignore[attr-defined]


class FixedShmGroup:
    """Every collective on one given shared-memory group (the cache cycles' own, of every
    rank of a job on one host)."""

    def __init__(self, group):
        self.group = group

    def usable(self) -> bool:
        return True

    def supports(self, group: Group) -> bool:
        return True

    def get(self, group: Group, deadline: float):
        return self.group

    def close(self) -> None:
        self.group.close()


# DDL_SHM_ALLREDUCE_ALGORITHM -> small_bytes (None: the size-based default)
_SMALL_BYTES = {"auto": None, "one_round": 1 << 62, "reduce_scatter": 0}
# the Timeline's algorithm of the collectives that have one
_ALGORITHMS = {pb.ALLGATHER: "banks", pb.BROADCAST: "banks", pb.ALLTOALL: "parts",
               pb.REDUCESCATTER: "reduce_scatter"}


class ShmBackend(Backend):
    """Shared memory among members on this host
    (:mod:`ddl.dataplane.algorithms.shm_collectives`)."""

    name = "shm"

    def __init__(self, plane):
        super().__init__(plane)
        from ddl.dataplane.algorithms import shm_collectives
        self._c = shm_collectives
        self._groups = plane.shm_groups
        self._small_bytes = _SMALL_BYTES[self.config.shm_allreduce_algorithm]

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        return self._groups.supports(group)

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        if op == pb.ALLREDUCE:
            return self._c.allreduce_algorithm(nbytes, self._groups.get(group, deadline),
                                               self._small_bytes)
        return _ALGORITHMS[op]

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        self._c.allreduce(buf, op, self._groups.get(group, deadline), deadline, src=src,
                          small_bytes=self._small_bytes)

    def allgatherv(self, send, out, counts: Sequence[int], group, deadline) -> None:
        self._c.allgatherv(send, out, counts, self._groups.get(group, deadline), deadline)

    def broadcast(self, buf, root_index: int, group, deadline) -> None:
        self._c.broadcast(buf, root_index, self._groups.get(group, deadline), deadline)

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        self._c.alltoallv(send, send_counts, recv, recv_counts,
                          self._groups.get(group, deadline), deadline)

    def reducescatter(self, buf: np.ndarray, counts, op, group, deadline) -> None:
        self._c.reducescatter(buf, counts, op, self._groups.get(group, deadline), deadline)
