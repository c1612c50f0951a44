"""Backends: the data paths of collectives, and the one place where one is chosen.

:data:`ORDER` lists the backend classes by preference; for each collective,
:meth:`Backends.pick` returns the first whose ``supports(op, group, nbytes)`` is true.
Shared memory wins within a host, hierarchical (shared memory within hosts, TCP across)
where it is enabled and the hosts are balanced, TCP carries everything else, so it is
last. To add a backend, write one module with a
:class:`~ddl.dataplane.backends.base.Backend` subclass (the contract is in
:mod:`ddl.dataplane.backends.base`) and add it here.

Device buffers (CuPy arrays, ``memory="cuda"``) take the backends of :data:`DEVICE_ORDER`
instead: CUDA IPC within a group whose GPUs map each other's memory, NCCL among ranks each
on a GPU of its own that cannot all do so, IPC within islands joined by NCCL (allreduce
and broadcast) where two ranks of a job of several hosts share a GPU, else staged through
the host backends. Which one is the group's device plan (:attr:`DataPlane.device_plans`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Type

from ddl.dataplane.backends.base import Backend, CycleChannel, CycleSetup, DataPlane
from ddl.dataplane.backends.cuda_ipc import CudaIpcBackend, StagedBackend
from ddl.dataplane.backends.device_hierarchical import DeviceHierarchicalBackend
from ddl.dataplane.backends.hierarchical import HierarchicalBackend
from ddl.dataplane.backends.nccl import NcclBackend
from ddl.dataplane.backends.shm import ShmBackend
from ddl.dataplane.backends.tcp import TcpBackend
from ddl.dataplane.transports.base import Group

ORDER: Tuple[Type[Backend], ...] = (ShmBackend, HierarchicalBackend, TcpBackend)
DEVICE_ORDER: Tuple[Type[Backend], ...] = (CudaIpcBackend, NcclBackend,
                                           DeviceHierarchicalBackend, StagedBackend)


class Backends:
    """One instance of every backend of :data:`ORDER` over one :class:`DataPlane`."""

    def __init__(self, plane: DataPlane, order: Sequence[Type[Backend]] = ORDER,
                 device_order: Sequence[Type[Backend]] = DEVICE_ORDER):
        self.plane = plane
        self.backends = tuple(cls(plane) for cls in order)
        self.device = tuple(cls(plane) for cls in device_order)
        by_name = {backend.name: backend for backend in self.device}
        for backend in self.device:
            if isinstance(backend, (StagedBackend, NcclBackend)):
                backend.host_pick = self.pick
            if isinstance(backend, DeviceHierarchicalBackend):
                backend.ipc, backend.nccl = by_name["cuda_ipc"], by_name["nccl"]

    def pick(self, op: int, group: Group, nbytes: int, memory: str = "") -> Backend:
        """The first backend that supports ``op`` among ``group`` for ``nbytes`` (the
        same on every member: each ``supports`` decides from shared facts); ``memory``:
        where the buffers live ("" host, "cuda" device)."""
        for backend in (self.device if memory else self.backends):
            if backend.supports(op, group, nbytes):
                return backend
        raise RuntimeError(f"no backend carries op {op} among ranks {list(group.ranks)}"
                           f"{' for ' + memory + ' memory' if memory else ''}")

    def cycle_channel(self, setup: CycleSetup) -> Optional[CycleChannel]:
        """The first backend's channel for the response cache's cycles; None (no cycles)
        when no backend carries them."""
        for backend in self.backends:
            channel = backend.cycle_channel(setup)
            if channel is not None:
                return channel
        return None

    def close(self) -> None:
        for backend in self.device + self.backends:
            backend.close()


__all__ = ["Backend", "Backends", "CycleChannel", "CycleSetup", "DataPlane", "DEVICE_ORDER",
           "ORDER"]
