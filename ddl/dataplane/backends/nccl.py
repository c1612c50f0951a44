"""The NCCL device backend: device arrays among ranks that cannot all map each other's
memory, each rank on a GPU of its own (several hosts of one GPU or of many connected
ones, or GPUs of one host without peer access; with ``DDL_NCCL=on`` also peer GPUs of one
host), over one NCCL communicator per group (:mod:`ddl.dataplane.device.nccl`).

It carries a group whose device plan's path is ``"nccl"``
(:mod:`ddl.dataplane.backends.device_plan`: NCCL loads on every member, ``DDL_NCCL`` is
not ``off`` and no two members share a GPU), and the leaders' stage of a
``"hierarchical"`` plan (:mod:`ddl.dataplane.backends.device_hierarchical`). The
communicator's id travels from the group's first member over the host data path that the
same group's host broadcast takes (shared memory or the job's authenticated TCP
connections), in the group's first device collective, which every member reaches at the
same point of the global order.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np

from ddl.dataplane.backends.base import Backend, staged_reducescatter
from ddl.dataplane.backends.device_plan import NCCL
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb


class NcclBackend(Backend):
    """Device collectives over NCCL among the members of a group planned ``"nccl"``."""

    name = "nccl"
    memory = "cuda"

    def __init__(self, plane, host_pick=None):
        super().__init__(plane)
        self.host_pick = host_pick   # set by Backends: the host backends' pick
        self._comms: Dict[Tuple[int, ...], Any] = {}   # members -> NcclComm

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        plan = self.plane.device_plans.get(group.ranks)
        return plan is not None and plan.path == NCCL and group.size > 1

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        return {pb.ALLREDUCE: "allreduce", pb.ALLGATHER: "allgather",
                pb.BROADCAST: "broadcast", pb.ALLTOALL: "send_recv",
                pb.REDUCESCATTER: "reduce"}[op]

    def _comm(self, group: Group, deadline: float):
        from ddl.dataplane.device import cuda, nccl

        device = cuda.current_device()
        found = self._comms.get(group.ranks)
        if found is not None:
            if found.device != device:
                raise ValueError(f"device collective among ranks {list(group.ranks)}: rank "
                                 f"{group.rank} passed arrays on cuda:{device}, but its "
                                 f"first device collective among these ranks was on cuda:"
                                 f"{found.device}; keep each rank's arrays on one GPU (use "
                                 f"torch.cuda.set_device(local_rank))")
            return found
        uid = nccl.unique_id() if group.index == 0 else np.zeros(nccl.UNIQUE_ID_BYTES,
                                                                 np.uint8)
        self.host_pick(pb.BROADCAST, group, uid.nbytes).broadcast(uid, 0, group, deadline)
        found = nccl.NcclComm(uid, group.size, group.index, device, group.ranks,
                              self.plane.abort_check).connect(deadline)
        self._comms[group.ranks] = found
        return found

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        self._comm(group, deadline).allreduce(buf, op, deadline, src=src)

    def allgatherv(self, send, out, counts: Sequence[int], group, deadline) -> None:
        self._comm(group, deadline).allgatherv(send, out, counts, deadline)

    def broadcast(self, buf, root_index: int, group, deadline, src=None) -> None:
        self._comm(group, deadline).broadcast(buf, root_index, deadline, src=src)

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        self._comm(group, deadline).alltoallv(send, send_counts, recv, recv_counts,
                                              deadline)

    def reducescatter(self, buf, counts, op, group, deadline, src=None, out=None,
                      pack=None) -> None:
        staged_reducescatter(
            lambda b: self._comm(group, deadline).reducescatter(b, counts, op, deadline),
            buf, counts, group, src, out, pack)

    def close(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        for comm in comms:
            comm.close()
