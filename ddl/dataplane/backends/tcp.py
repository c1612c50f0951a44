"""The TCP backend: every collective among any members, over the job's TCP connections.

Thin adapter over the algorithms of :mod:`ddl.dataplane.algorithms` (ring, recursive doubling,
pipelined chain, pairwise exchange); ``DDL_ALLREDUCE_ALGORITHM``,
``DDL_SMALL_MESSAGE_BYTES`` and ``DDL_TCP_CHUNK_BYTES`` tune them. It supports every call,
so it is the last entry of :data:`ddl.dataplane.backends.ORDER`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ddl.core.dtypes import ReduceOp
from ddl.dataplane import algorithms as collectives
from ddl.dataplane.backends.base import (Backend, CycleChannel, CycleSetup, DataPlane,
                                         staged_reducescatter)
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb

_ALGORITHMS = {pb.ALLGATHER: "ring", pb.BROADCAST: "pipelined_chain",
               pb.ALLTOALL: "pairwise", pb.REDUCESCATTER: "ring"}


def allreduce_algorithm(config, nbytes: int) -> str:
    """The TCP allreduce algorithm for ``nbytes`` (DDL_ALLREDUCE_ALGORITHM, or by size)."""
    if config.allreduce_algorithm != "auto":
        return config.allreduce_algorithm
    return "recursive_doubling" if nbytes <= config.small_message_bytes else "ring"


class TcpBackend(Backend):
    """Any group, over TCP (:mod:`ddl.dataplane.algorithms`)."""

    name = "tcp"

    def __init__(self, plane):
        super().__init__(plane)
        self.transport = plane.transport

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        return True

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        if op == pb.ALLREDUCE:
            return allreduce_algorithm(self.config, nbytes)
        return _ALGORITHMS[op]

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        cfg = self.config
        collectives.allreduce(buf, op, group, self.transport, deadline,
                              algorithm=cfg.allreduce_algorithm,
                              small_message_bytes=cfg.small_message_bytes,
                              chunk_bytes=cfg.tcp_chunk_bytes, src=src)

    def allgatherv(self, send, out, counts, group, deadline) -> None:
        collectives.allgatherv(send, out, counts, group, self.transport, deadline)

    def broadcast(self, buf, root_index, group, deadline, src=None) -> None:
        if src is not None:
            buf[:] = src
        collectives.broadcast(buf, root_index, group, self.transport, deadline,
                              chunk_bytes=self.config.tcp_chunk_bytes)

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        collectives.alltoallv(send, send_counts, recv, recv_counts, group, self.transport,
                              deadline)

    def reducescatter(self, buf, counts, op, group, deadline, src=None, out=None,
                      pack=None) -> None:
        staged_reducescatter(
            lambda b: collectives.reducescatter(b, counts, op, group, self.transport,
                                                deadline,
                                                chunk_bytes=self.config.tcp_chunk_bytes),
            buf, counts, group, src, out, pack)

    def cycle_channel(self, setup: CycleSetup) -> Optional[CycleChannel]:
        """Ranks on several hosts (or ``DDL_TRANSPORT=tcp``): the cycles vote over TCP
        connections of their own (:class:`TcpVotes`); their collectives use a set of
        shared-memory groups of their own for the hierarchical paths."""
        transport = setup.transport
        if transport is None or not all(setup.addresses.get(r) for r in setup.world.ranks):
            return None
        transport.set_peers({r: setup.addresses[r] for r in setup.world.ranks})
        groups = self.plane.shm_groups.twin("c", setup.abort_check)
        plane = DataPlane(self.plane.rank, self.config, transport, groups, self.plane.hosts,
                          abort_check=setup.abort_check)
        return CycleChannel(TcpVotes(transport, setup.world, setup.capacity), plane,
                            uses_transport=True, close=groups.close)


class TcpVotes:
    """A cycle's round over TCP (ranks on several hosts, or ``DDL_TRANSPORT=tcp``): the
    votes are reduced with Min by recursive doubling on the cycles' own connections;
    there is no inline area (nor lone place), so every ready call then runs as a
    collective."""

    inline = False
    lone = 0

    def __init__(self, transport, world: Group, capacity: int):
        self._transport = transport
        self._group = world
        self.outcome = np.zeros(capacity + 1, dtype=np.int8)

    def lone_fits(self, call) -> bool:
        return False

    def exchange(self, vote: np.ndarray, inline, deadline: float, lone=None) -> None:
        out = self.outcome
        np.copyto(out, vote)
        collectives.allreduce(out, ReduceOp.Min, self._group, self._transport, deadline,
                              algorithm="recursive_doubling")
        return None

    def abandon(self) -> None:
        """The job failed: close the cycles' connections at once, so that a rank blocked
        on this one learns now rather than when this process exits."""
        self._transport.close()
