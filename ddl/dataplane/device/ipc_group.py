"""A group of ranks on one host whose GPUs map each other's memory (an IPC island).

Each member allocates one device segment (two banks of one slot each) with
``cudaMalloc``, exposes it once through a CUDA IPC handle written into the host
shared-memory group of the same members (the job's authenticated channel: its segment is
named from the job secret), and opens every peer's handle. The collectives then read and
write the members' slots with device kernels (:mod:`.collectives`), while the *rounds*
are the host group's (:class:`~ddl.dataplane.transports.shm.ShmGroup`: flags, futex
waits with deadlines, liveness checks, the job's abort word), so a dead or frozen peer
fails every other member with a named error exactly as on the host paths.

One rule makes device work safe under host rounds: :meth:`IpcGroup.publish` first waits
(on the host, with a deadline) until this rank's stream has finished everything queued
so far. Entering a device round thus says "my writes for it are on the device, and my
reads of the previous device rounds are done", which is what the host protocol's flags
mean. No kernel ever waits for another process.

The two banks of device slots alternate by the group's own count of *device* rounds, not
by the host group's rounds, which the members also take without the device (a cycle's
vote, host collectives of the same members): those need not wait for the GPU. A device
bank is written again two device rounds after its last use, once every member has
entered the device round in between (:meth:`begin` waits for the host round this rank
is at), so after each has finished reading it.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ddl.core import faults as _faults
from ddl.dataplane.device import cuda
from ddl.dataplane.transports.shm import descriptor

_HANDLE_BYTES = 64   # cudaIpcMemHandle_t
CLOSE_WAIT_S = 5.0   # how long a closing member waits for the others (IpcGroup.close)


class IpcGroup:
    """The same interface as :class:`~ddl.dataplane.transports.shm.ShmGroup` for the
    collectives (``index``, ``size``, ``peers``, ``slot_bytes``, ``cma``, ``round``,
    ``check``, ``begin``, ``publish``, ``wait_all``, ``wait_peer``, ``fail``,
    ``slots``, ``meta_slots``), with the slots in device memory.

    Cross-rank contract: every member constructs it over its host group of the same
    members, with the same ``slot_bytes`` (:meth:`connect` raises MismatchError on every
    member otherwise), then calls :meth:`connect` at the same point of the global order
    (the first device collective of these members)."""

    cma = False   # no cross-memory attach: the slots are the only way between members

    def __init__(self, host: Any, device: int, slot_bytes: int):
        self.host = host
        self.index, self.size, self.peers = host.index, host.size, host.peers
        self.device = int(device)
        self.slot_bytes = int(slot_bytes) // 512 * 512
        self.stream = cuda.stream(self.device)
        self._deadline = time.monotonic() + 60.0
        self._base = 0                # this rank's segment (cudaMalloc)
        self._opened: List[int] = []  # peers' mapped segments, to close
        self._segments: Tuple[Any, ...] = ()   # every member's segment as uint8
        self._views: Dict[tuple, Tuple[Any, ...]] = {}
        self._closed = False
        self._seq = 0         # device rounds this rank has entered (the banks' turns)
        self._host_bank = 0   # the host group's bank of the current round (meta_slots)

    @property
    def round(self) -> int:
        """Device rounds this rank has entered; the current one's bank is ``round % 2``."""
        return self._seq

    def connect(self, deadline: float) -> "IpcGroup":
        """Allocate this rank's segment, exchange IPC handles, open the peers'."""
        cp = cuda.cupy()
        rt = cp.cuda.runtime
        nbytes = 2 * self.slot_bytes
        with cp.cuda.Device(self.device):
            try:   # (a slot too large for the GPU fails here: the peers hear it too)
                self._base = rt.malloc(nbytes)
                handle = bytes(rt.ipcGetMemHandle(self._base))
                self.host.check("cuda ipc connect")
                rows = self.host.slots(self.host.begin(deadline, "cuda ipc connect"),
                                       np.dtype(np.uint8), _HANDLE_BYTES)
                rows[self.index][:] = np.frombuffer(handle, np.uint8)
                # the members' slots must be the same size (DDL_CUDA_IPC_SLOT_MB): a
                # member reads and writes the others' at its own offsets
                desc = descriptor("connect", self.slot_bytes)
                self.host.publish(desc)
                self.host.wait_all(deadline, "cuda ipc connect (DDL_CUDA_IPC_SLOT_MB)",
                                   desc=desc)
                segments = []
                for j in range(self.size):
                    if j == self.index:
                        ptr = self._base
                    else:
                        ptr = rt.ipcOpenMemHandle(bytes(rows[j]),
                                                  rt.cudaIpcMemLazyEnablePeerAccess)
                        self._opened.append(ptr)
                    mem = cp.cuda.UnownedMemory(ptr, nbytes, self, self.device)
                    segments.append(cp.ndarray((nbytes,), np.uint8,
                                               cp.cuda.MemoryPointer(mem, 0)))
                self._segments = tuple(segments)
                # nobody may close a peer's round of handles before everyone opened them
                self.host.begin(deadline, "cuda ipc connect")
                self.host.publish()
                self.host.wait_all(deadline, "cuda ipc connect")
            except BaseException as exc:
                self.host.fail(exc)
                self._release()
                raise
        return self

    # -- the ShmGroup interface --------------------------------------------------------
    def check(self, what: str) -> None:
        self.host.check(what)

    def begin(self, deadline: float, what: str) -> int:
        """Start the next device round (the host group's next round): its device bank."""
        self._deadline = deadline
        self._host_bank = self.host.begin(deadline, what)
        return (self._seq + 1) & 1

    def publish(self, desc: Optional[Tuple[int, int, int]] = None) -> None:
        """Enter the next device round once this rank's stream has done all it was given
        (waited for on the host, with the round's deadline and the group's checks)."""
        if _faults.ACTIVE is not None: _faults.hit("device.round")
        cuda.settle(self.stream, self._deadline, "collective", self._check)
        self._seq += 1
        self.host.publish(desc)

    def _check(self) -> None:
        self.host.check("collective")

    def wait_all(self, deadline: float, what: str, desc=None) -> None:
        self.host.wait_all(deadline, what, desc)

    def wait_peer(self, j: int, deadline: float, what: str, desc=None) -> None:
        self.host.wait_peer(j, deadline, what, desc)

    def fail(self, exc: BaseException) -> None:
        self.host.fail(exc)

    def slots(self, bank: int, dtype: np.dtype, count: int) -> Tuple[Any, ...]:
        """Each member's device slot in ``bank`` as ``count`` elements of ``dtype``."""
        key = (bank, dtype, count)
        views = self._views.get(key)
        if views is None:
            a = bank * self.slot_bytes
            nbytes = count * np.dtype(dtype).itemsize
            views = tuple(s[a:a + nbytes].view(dtype) for s in self._segments)
            if len(self._views) >= 64:
                self._views.pop(next(iter(self._views)))
            self._views[key] = views
        return views

    def meta_slots(self, bank: int, dtype: np.dtype, count: int) -> Tuple[Any, ...]:
        """Each member's host slot in the current round, for a collective's counts
        (``bank``, the device bank :meth:`begin` returned, is not the host's)."""
        return self.host.slots(self._host_bank, dtype, count)

    # -- lifetime ----------------------------------------------------------------------
    def _release(self) -> None:
        cp = cuda.cupy()
        rt = cp.cuda.runtime
        self._views.clear()
        self._segments = ()
        with cp.cuda.Device(self.device):
            try:   # our kernels wait for nobody: they end; the deadline is a guard
                cuda.settle(self.stream, time.monotonic() + 10.0, "close")
            except Exception:
                pass
            for ptr in self._opened:
                try:
                    rt.ipcCloseMemHandle(ptr)
                except Exception:
                    pass
            self._opened = []
            if self._base:
                try:
                    rt.free(self._base)
                except Exception:
                    pass
                self._base = 0

    def close(self) -> None:
        """Unmap the peers' segments and free this rank's (idempotent), after a last
        round of the members (:meth:`ShmGroup.last_round
        <ddl.dataplane.transports.shm.ShmGroup.last_round>`, up to :data:`CLOSE_WAIT_S`):
        a peer's stream may still have to read this rank's slot for the last collective
        (its kernels were queued after that collective's last round), and it enters the
        last round only once its stream is done. A peer that does not come within the
        wait is dead or busy elsewhere, with its stream long done. The host group belongs
        to its owner.

        Cross-rank contract: the members close their groups in the same order
        (:meth:`CudaIpcBackend.close
        <ddl.dataplane.backends.cuda_ipc.CudaIpcBackend.close>`: by members), after
        their last collective on it."""
        if not self._closed:
            self._closed = True
            try:
                if self._segments:
                    deadline = time.monotonic() + CLOSE_WAIT_S
                    try:   # this rank's reads of the peers' slots end first
                        cuda.settle(self.stream, deadline, "close")
                    except Exception:
                        pass
                    self.host.last_round(deadline, "cuda ipc close")
            finally:
                self._release()
