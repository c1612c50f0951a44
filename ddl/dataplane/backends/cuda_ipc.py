"""Device backends: CUDA IPC within an island of GPUs that map each other's memory, and
host staging for every other group of device arrays.

Both carry buffers that are CuPy arrays (``memory = "cuda"``); the executor picks among
them only for device calls (:meth:`ddl.dataplane.backends.Backends.pick`). Which one a
group takes is its device plan (:mod:`ddl.dataplane.backends.device_plan`), agreed by
every member in the group's first device collective and kept in
:attr:`DataPlane.device_plans`, so ``supports`` answers the same everywhere.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np

from ddl.dataplane.backends.base import Backend, staged_reducescatter
from ddl.dataplane.backends.device_plan import IPC
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb


class CudaIpcBackend(Backend):
    """Device kernels over CUDA IPC among the members of one island
    (:mod:`ddl.dataplane.device.collectives`), rounds on the members' host
    shared-memory group."""

    name = "cuda_ipc"
    memory = "cuda"

    def __init__(self, plane):
        super().__init__(plane)
        self._groups: Dict[Tuple[int, ...], Any] = {}   # members -> IpcGroup

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        plan = self.plane.device_plans.get(group.ranks)
        if plan is None or plan.path != IPC:
            return False
        return group.size == 1 or self.plane.shm_groups.supports(group)

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        if group.size == 1:
            return "local"
        if op == pb.ALLREDUCE:
            from ddl.dataplane.device import collectives
            return collectives.allreduce_algorithm(nbytes, self._group(group, deadline),
                                                   self.config.shm_allreduce_algorithm)
        return {pb.ALLGATHER: "slots", pb.BROADCAST: "slots", pb.ALLTOALL: "parts",
                pb.REDUCESCATTER: "reduce_scatter"}[op]

    def _group(self, group: Group, deadline: float):
        from ddl.dataplane.device import cuda
        from ddl.dataplane.device.ipc_group import IpcGroup

        device = cuda.current_device()
        found = self._groups.get(group.ranks)
        if found is None:
            host = self.plane.shm_groups.get(group, deadline)
            found = IpcGroup(host, device, self.config.cuda_ipc_slot_mb << 20).connect(
                deadline)
            self._groups[group.ranks] = found
        elif found.device != device:
            raise ValueError(f"device collective among ranks {list(group.ranks)}: rank "
                             f"{group.rank} passed arrays on cuda:{device}, but its first "
                             f"device collective among these ranks was on cuda:"
                             f"{found.device}; keep each rank's arrays on one GPU (use "
                             f"torch.cuda.set_device(local_rank))")
        return found

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        from ddl.dataplane.device import collectives
        if group.size == 1:
            if src is not None:
                buf[:] = src
            return
        collectives.allreduce(buf, op, self._group(group, deadline), deadline, src=src,
                              algorithm=self.config.shm_allreduce_algorithm)

    def allgatherv(self, send, out, counts: Sequence[int], group, deadline) -> None:
        from ddl.dataplane.device import collectives
        if group.size == 1:
            out[:] = send
            return
        collectives.allgatherv(send, out, counts, self._group(group, deadline), deadline)

    def broadcast(self, buf, root_index: int, group, deadline, src=None) -> None:
        from ddl.dataplane.device import collectives
        if group.size == 1:
            if src is not None:
                buf[:] = src
            return
        collectives.broadcast(buf, root_index, self._group(group, deadline), deadline,
                              src=src)

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        from ddl.dataplane.device import collectives
        if group.size == 1:
            recv[:] = send
            return
        collectives.alltoallv(send, send_counts, recv, recv_counts,
                              self._group(group, deadline), deadline)

    def reducescatter(self, buf, counts, op, group, deadline, src=None, out=None,
                      pack=None) -> None:
        from ddl.dataplane.device import collectives
        if group.size == 1:   # (nothing to reduce: src into out, or into buf)
            staged_reducescatter(lambda b: None, buf, counts, group, src, out, pack)
            return
        collectives.reducescatter(buf, counts, op, self._group(group, deadline), deadline,
                                  src=src, out=out, pack=pack)

    def close(self) -> None:
        """Close this rank's IPC groups in the order of their members, the same on
        every rank: each close waits for the other members of its group
        (:meth:`IpcGroup.close <ddl.dataplane.device.ipc_group.IpcGroup.close>`)."""
        groups, self._groups = self._groups, {}
        first = None
        for ranks in sorted(groups):
            try:
                groups[ranks].close()
            except BaseException as exc:   # (an interrupt: the others are freed still)
                first = first or exc
        if first is not None:
            raise first


class StagedBackend(Backend):
    """Device buffers through host memory: each buffer is copied to the host, the host
    backend that the same call would take moves it, and the result is copied back. For
    groups whose devices cannot map each other's memory (several hosts, GPUs without
    peer access) until an NCCL path serves them."""

    name = "staged"
    memory = "cuda"

    def __init__(self, plane, host_pick=None):
        super().__init__(plane)
        self.host_pick = host_pick   # set by Backends: the host backends' pick

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        return group.ranks in self.plane.device_plans

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        host = self.host_pick(op, group, nbytes)
        return f"{host.name}:{host.algorithm(op, group, nbytes, deadline)}"

    @staticmethod
    def _host(arr, deadline: float) -> np.ndarray:
        from ddl.dataplane.device import cuda
        return cuda.to_host(arr, deadline, "staged collective")

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        host = self._host(buf if src is None else src, deadline)
        self.host_pick(pb.ALLREDUCE, group, buf.nbytes).allreduce(host, op, group, deadline)
        buf.set(host)

    def allgatherv(self, send, out, counts, group, deadline) -> None:
        host_out = np.empty(out.nbytes, np.uint8)
        self.host_pick(pb.ALLGATHER, group, out.nbytes).allgatherv(
            self._host(send, deadline), host_out, counts, group, deadline)
        out.set(host_out)

    def broadcast(self, buf, root_index, group, deadline, src=None) -> None:
        host = self._host(buf if src is None else src, deadline)
        self.host_pick(pb.BROADCAST, group, buf.nbytes).broadcast(host, root_index, group,
                                                                   deadline)
        buf.set(host)

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        host_recv = np.empty(recv.nbytes, np.uint8)
        self.host_pick(pb.ALLTOALL, group, recv.nbytes).alltoallv(
            self._host(send, deadline), send_counts, host_recv, recv_counts, group, deadline)
        recv.set(host_recv)

    def reducescatter(self, buf, counts, op, group, deadline, src=None, out=None,
                      pack=None) -> None:
        def run(b) -> None:
            host = self._host(b, deadline)
            self.host_pick(pb.REDUCESCATTER, group, b.nbytes).reducescatter(
                host, counts, op, group, deadline)
            b.set(host)
        staged_reducescatter(run, buf, counts, group, src, out, pack)
