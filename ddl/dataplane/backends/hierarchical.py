"""The hierarchical backend: shared memory within each host, TCP across hosts.

Thin adapter over :mod:`ddl.dataplane.algorithms.hierarchical`. It carries a group whose hosts
each hold the same number (two or more) of its members, when shared memory is usable:

* allreduce: ``DDL_HIERARCHICAL_ALLREDUCE`` ``on``, or ``auto`` above
  ``DDL_SMALL_MESSAGE_BYTES`` (as measured);
* allgather: ``DDL_HIERARCHICAL_ALLGATHER`` ``on`` (``auto`` is off, as measured);
* nothing else (TCP carries the rest).
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ddl.dataplane.backends.base import Backend
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb

_ON = ("on", "1")


def hierarchy(group: Group, hosts, rank: int):
    """The :class:`~ddl.dataplane.algorithms.hierarchical.Hierarchy` of ``group`` given every
    rank's host (``hosts``): this rank's host mates, the members with this rank's
    position on every host, and every host's members. None when ``group`` sits on one
    host, or its hosts hold different numbers of members (or one each: nothing to gain)."""
    by_host: Dict[str, list] = {}
    for r in group.ranks:
        by_host.setdefault(hosts.get(r, ""), []).append(r)
    sizes = {len(members) for members in by_host.values()}
    if len(by_host) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    from ddl.dataplane.algorithms.hierarchical import Hierarchy
    mine = by_host[hosts.get(rank, "")]
    position = mine.index(rank)
    cross = [members[position] for members in by_host.values()]
    shape = tuple(sorted(tuple(sorted(m)) for m in by_host.values()))
    return Hierarchy(Group.of(mine, rank), Group.of(cross, rank), shape)


class HierarchicalBackend(Backend):
    """Allreduce and allgather over several hosts in three stages (see the module doc)."""

    name = "shm+tcp"

    def __init__(self, plane):
        super().__init__(plane)
        from ddl.dataplane.algorithms import hierarchical
        self._c = hierarchical
        self._hierarchies: Dict[tuple, Optional[object]] = {}

    def _hierarchy(self, group: Group):
        if group.ranks not in self._hierarchies:
            groups = self.plane.shm_groups
            self._hierarchies[group.ranks] = (
                hierarchy(group, self.plane.hosts, self.plane.rank)
                if groups.usable() else None)
        return self._hierarchies[group.ranks]

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        cfg = self.config
        if op == pb.ALLREDUCE:
            mode = cfg.hierarchical_allreduce
            if mode in ("off", "0") or (mode == "auto"
                                        and nbytes <= cfg.small_message_bytes):
                return False
        elif op != pb.ALLGATHER or cfg.hierarchical_allgather not in _ON:
            return False
        return self._hierarchy(group) is not None

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        return "hierarchical"

    def _local(self, h, deadline: float):
        return self.plane.shm_groups.get(h.local, deadline)

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        if src is not None:
            np.copyto(buf, src)
        cfg, h = self.config, self._hierarchy(group)
        self._c.allreduce(buf, op, h, self._local(h, deadline), self.plane.transport,
                          deadline, algorithm=cfg.allreduce_algorithm,
                          small_message_bytes=cfg.small_message_bytes,
                          chunk_bytes=cfg.tcp_chunk_bytes)

    def allgatherv(self, send, out, counts, group, deadline) -> None:
        h = self._hierarchy(group)
        self._c.allgatherv(send, out, counts, group, h, self._local(h, deadline),
                           self.plane.transport, deadline)

    def _unsupported(self, what: str):
        raise NotImplementedError(f"the hierarchical backend does not run {what}")

    def broadcast(self, buf, root_index, group, deadline, src=None) -> None:
        self._unsupported("broadcast")

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        self._unsupported("alltoallv")

    def reducescatter(self, buf, counts, op, group, deadline, src=None, out=None,
                      pack=None) -> None:
        self._unsupported("reducescatter")
