"""The hierarchical device backend: CUDA IPC within each island of a group, NCCL among one
leader per island, for a group whose device plan is ``"hierarchical"``
(:mod:`ddl.dataplane.backends.device_plan`: ranks of several hosts, two of them on one
GPU, so that no flat NCCL communicator can hold them all).

* **allreduce**: the island's members allreduce over CUDA IPC; the leaders (each island's
  first member) allreduce those partial results over NCCL; each leader broadcasts the
  total within its island over CUDA IPC. Every member ends with the leaders' NCCL result,
  so results are bitwise equal everywhere (though not in the member order of a flat
  reduction).
* **broadcast**: within the root's island over IPC, among the leaders over NCCL from the
  root's island's leader, then within every other island from its leader.

The other collectives are staged through the host (:class:`StagedBackend`, next in
``DEVICE_ORDER``). The stages reuse the CUDA IPC and NCCL backends' groups and
communicators (keyed by their members), which the global order keeps in step: every
member of a stage reaches it at the same point of the order.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ddl.dataplane.backends.base import Backend
from ddl.dataplane.backends.device_plan import HIERARCHICAL
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb

_U8 = np.dtype(np.uint8)


class DeviceHierarchicalBackend(Backend):
    """Allreduce and broadcast of device arrays among IPC islands joined by NCCL."""

    name = "cuda_ipc+nccl"
    memory = "cuda"

    def __init__(self, plane, ipc=None, nccl=None):
        super().__init__(plane)
        self.ipc, self.nccl = ipc, nccl   # set by Backends: its CUDA IPC and NCCL backends

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        plan = self.plane.device_plans.get(group.ranks)
        return (plan is not None and plan.path == HIERARCHICAL
                and op in (pb.ALLREDUCE, pb.BROADCAST))

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        return "islands"

    def _parts(self, group: Group) -> Tuple[Group, Optional[Group], tuple]:
        """(my island's group, the leaders' group if I lead my island, every island's
        member indices) of ``group``."""
        plan = self.plane.device_plans[group.ranks]
        mine = next(island for island in plan.islands if group.index in island)
        me = self.plane.rank
        island = Group.of([group.ranks[k] for k in mine], me)
        leaders = [group.ranks[k] for k in plan.leaders]
        return island, (Group.of(leaders, me) if me in leaders else None), plan.islands

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        island, leaders, _ = self._parts(group)
        self.ipc.allreduce(buf, op, island, deadline, src=src)
        if leaders is not None:
            self.nccl.allreduce(buf, op, leaders, deadline)
        self.ipc.broadcast(buf.reshape(-1).view(_U8), 0, island, deadline)

    def broadcast(self, buf, root_index: int, group, deadline, src=None) -> None:
        island, leaders, islands = self._parts(group)
        rooted = next(isl for isl in islands if root_index in isl)
        if group.index in rooted:
            self.ipc.broadcast(buf, rooted.index(root_index), island, deadline, src=src)
        if leaders is not None:
            root_leader = leaders.ranks.index(group.ranks[rooted[0]])
            self.nccl.broadcast(buf, root_leader, leaders, deadline)
        if group.index not in rooted:
            self.ipc.broadcast(buf, 0, island, deadline)

    def _unsupported(self, what: str):   # supports() never picks it for these
        raise NotImplementedError(f"the hierarchical device backend does not run {what}")

    def allgatherv(self, send, out, counts, group, deadline) -> None:
        self._unsupported("allgatherv")

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        self._unsupported("alltoallv")

    def reducescatter(self, buf, counts, op, group, deadline, src=None, out=None,
                      pack=None) -> None:
        self._unsupported("reducescatter")
