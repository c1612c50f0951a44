"""Shared-memory transport: the ranks of one host meet in one segment of ``/dev/shm``.

A :class:`ShmGroup` is this process's membership of one such meeting: ``local_size``
processes, each knowing its ``local_rank``. The algorithms that move and reduce bytes
through it live in :mod:`ddl.dataplane.algorithms.shm_collectives`; this module owns the
segment, the rendezvous, the synchronization and the failure handling, one part each:
the layout (:mod:`._shm_layout`), the rendezvous (:mod:`._shm_rendezvous`), cross-memory
attach (:mod:`._shm_cross_memory`), the rounds and waiting (:mod:`._shm_rounds`, with the
calls' descriptors, :mod:`._shm_descriptor`) and the failures (:mod:`._shm_failures`);
:class:`ShmGroup` puts them together with its state, data views and ``close``.

**Names.** A segment is ``/dev/shm/ddl-<job>-<128 bits>``: ``<job>`` is the job id (or a
hash of it), the 128 bits are HMAC-SHA256(job secret, job id | host key | tag), so every
local rank computes the name on its own, without a round of messages, and nobody without
the secret can guess it (to squat on it, or to open it). Local rank 0 creates the segment
exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) and fills in a header
authenticated with the secret; the others open it, check owner, mode, size and the
header, and attach. The group's ``tag`` tells apart groups of one job on one host that
exist at the same time (e.g. one per process set); reusing a tag after ``close()`` is fine.

**Lifetime.** As soon as every local rank has attached, the name is unlinked: the memory
lives on in the processes' mappings and disappears with the last of them, so a job that
crashes later leaves nothing behind. Only a crash during the rendezvous can leave a name;
a launcher removes those with :func:`cleanup_job_segments` once the job has ended.

**Rounds.** The data area holds two *banks*; each has one *slot* of ``slot_bytes`` per local
rank. Every rank owns one 64-bit counter, the number of rounds it has entered; a
collective is a fixed sequence of rounds that every rank derives from the same arguments.
Round ``r`` uses bank ``r % 2``. Entering round ``r`` (:meth:`ShmGroup.publish`) means: all
my reads of rounds before ``r`` are done, and whatever I write for round ``r`` is in place.
So a rank may write into a bank for round ``r`` once every peer has entered ``r - 1``
(:meth:`ShmGroup.begin` checks it), and may read a peer's data of round ``r`` once that peer
has entered ``r`` (:meth:`ShmGroup.wait_all`, :meth:`ShmGroup.wait_peer`). Each rank writes
only its own counter and its own parts of a bank, so no atomic read-modify-write is needed.

**Cross-memory attach.** Once every rank has attached, each publishes the address of a
16-byte token (an HMAC of the secret, the segment and its local rank) and reads every
peer's with ``process_vm_readv`` (:mod:`._cma`); a second round shares the verdicts, and
:attr:`ShmGroup.cma` is true on every rank only if every rank read every peer's token.
Then a collective may have a rank read a range that a peer published for it straight
from the peer's memory (:meth:`ShmGroup.read_peer`): one copy instead of two through a
bank. The kernel allows it where the reader could ``ptrace`` the owner (same user and
pid namespace, Yama and the container permitting); elsewhere the probe fails and
nothing changes.

**Waiting.** A waiter spins on the counter for about ``spin_us`` µs (not in ddl's own
background threads: see :func:`run_in_background`). When local ranks
outnumber this process's CPUs, spinning would take the core from the rank it waits for,
so it gives the CPU away (``sched_yield``, about 0.7 µs each when nothing else is
runnable) up to 30 times instead: a sleep and its wake-up cost tens of µs, while a yield
lets the rank it waits for run at once. Then it raises its
"sleeping on rank j" flag and sleeps in ``FUTEX_WAIT`` on the low word of j's counter. A
rank that enters a round fences, and calls ``FUTEX_WAKE`` only when a flag says somebody
sleeps on it (see :mod:`ddl.dataplane.transports._futex`). A sleeper wakes at least every
``poll_interval`` s to call ``abort_check``, to see whether the rank it waits for has died
(its pid is gone), closed or failed, and to compare with its deadline.

**Failure.** A collective that fails on one rank (deadline, ``abort_check``, a lost peer,
KeyboardInterrupt) leaves the rounds undefined, so the group is then broken: that rank
records the cause in the segment and wakes everyone; every rank raises
:class:`~ddl.PeerLostError` naming it, and every later call raises the same error again.

Thread-safety: one collective at a time per group (the engine thread runs them in order).
Linux only (``/dev/shm`` and futexes): :func:`available` says whether this host can.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ddl.core.cpus import usable_cpus
from ddl.dataplane.transports import _cma, _futex
from ddl.dataplane.transports import _shm_segment as seg
from ddl.dataplane.transports._shm_cross_memory import _CrossMemory
from ddl.dataplane.transports._shm_descriptor import describe, descriptor
from ddl.dataplane.transports._shm_failures import _Failures
from ddl.dataplane.transports._shm_layout import (_ATTACHED, _CLOSED, _LINE, _MSG_BYTES,
                                                  _SEQ_AT, PAGE)
from ddl.dataplane.transports._shm_rendezvous import _Rendezvous
from ddl.dataplane.transports._shm_rounds import _no_abort, _Rounds, run_in_background
from ddl.dataplane.transports._shm_segment import (SHM_DIR, SharedMemoryError, cleanup_job_segments,
                                                   segment_name, segment_prefix)
from ddl.dataplane.transports.base import AbortCheck

DEFAULT_SLOT_BYTES = 1 << 20       # per local rank and bank: 2 MiB of /dev/shm per local rank
MAX_LOCAL_SIZE = 256

__all__ = ["ShmGroup", "SharedMemoryError", "available", "cleanup_job_segments",
           "segment_name", "segment_prefix", "descriptor", "describe", "SHM_DIR",
           "DEFAULT_SLOT_BYTES", "run_in_background"]


def available(shm_dir: str = SHM_DIR) -> bool:
    """Whether this process can use shared-memory groups (Linux, futexes, ``shm_dir``)."""
    return (_futex.AVAILABLE and os.path.isdir(shm_dir)
            and (_futex.STRONG_ORDER or _futex.HAVE_FENCE))


class ShmGroup(_Rendezvous, _CrossMemory, _Rounds, _Failures):
    """This process's membership of the shared-memory group of the ranks on its host.

    Cross-rank contract: every local rank constructs the group with the same ``job_id``,
    ``secret``, ``host_key``, ``tag``, ``local_size`` and ``slot_bytes``, its own
    ``local_rank``, then calls :meth:`connect`; afterwards all run the same collectives of
    :mod:`ddl.dataplane.algorithms.shm_collectives` with matching arguments, in the same order.

    ``slot_bytes`` is the chunk one rank moves per round (rounded down to whole pages);
    the segment takes ``2 * local_size * slot_bytes`` plus a header page or two.
    ``ranks`` (global rank of each local rank) only makes error messages clearer.
    ``spin_us`` defaults to 200 µs, or 0 when local ranks outnumber usable CPUs (then a
    waiter yields the CPU up to 30 times before it sleeps).

    With ``cma`` (the default), :meth:`connect` also probes whether every rank can read
    every other's memory with cross-memory attach (:mod:`._cma`); :attr:`cma` is the
    verdict, the same on every rank, and :meth:`read_peer` the read. A rank passing
    ``cma=False`` turns it off for the whole group.

    Example::

        g = ShmGroup(job_id, secret, socket.gethostname(), local_rank, local_size).connect(
            time.monotonic() + 30)
        shm_collectives.allreduce(x, ReduceOp.Sum, g, time.monotonic() + 60)
        g.close()
    """

    name = "shm"

    def __init__(self, job_id: str, secret: bytes, host_key: str, local_rank: int,
                 local_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 abort_check: AbortCheck = _no_abort, *, tag: str = "world",
                 ranks: Optional[Sequence[int]] = None, spin_us: Optional[float] = None,
                 poll_interval: float = 0.05, shm_dir: str = SHM_DIR, cma: bool = True):
        if not 1 <= local_size <= MAX_LOCAL_SIZE:
            raise ValueError(f"ShmGroup: local_size must be in 1..{MAX_LOCAL_SIZE}, got "
                             f"{local_size}")
        if not 0 <= local_rank < local_size:
            raise ValueError(f"ShmGroup: local_rank {local_rank} is outside "
                             f"0..{local_size - 1}")
        if len(secret) < 16:
            raise ValueError("ShmGroup: the job secret must have at least 16 bytes")
        if slot_bytes < PAGE:
            raise ValueError(f"ShmGroup: slot_bytes must be at least {PAGE}, got {slot_bytes}")
        if not poll_interval > 0:
            raise ValueError(f"ShmGroup: poll_interval must be > 0, got {poll_interval}")
        if ranks is not None and len(ranks) != local_size:
            raise ValueError(f"ShmGroup: ranks has {len(ranks)} entries for local_size "
                             f"{local_size}")
        if local_size > 1 and not available(shm_dir):
            raise SharedMemoryError(
                f"shared-memory groups need Linux futexes and {shm_dir} (and libatomic on "
                f"this {sys.platform} machine); use the TCP transport instead")
        self.job_id, self.host_key, self.tag = job_id, host_key, tag
        self.index = self.local_rank = local_rank
        self.size = self.local_size = local_size
        self.slot_bytes = slot_bytes // PAGE * PAGE
        self.bank_bytes = self.slot_bytes * local_size
        self.ranks = tuple(int(r) for r in ranks) if ranks is not None else None
        self.path = os.path.join(shm_dir, segment_name(secret, job_id, host_key, tag))
        self._key = bytes(secret)
        self._abort_check: Callable[[], None] = abort_check
        self._poll = poll_interval
        crowded = local_size > usable_cpus()
        if spin_us is None:
            spin_us = 0.0 if crowded else 200.0
        self._spin = range(int(spin_us * 20))   # one spin iteration is about 50 ns
        self._yields = range(30 if crowded else 0)
        n = local_size
        self._info_at = _SEQ_AT + n * _LINE
        self._flag_stride = (n + _LINE - 1) // _LINE * _LINE
        self._flags_at = self._info_at + n * _LINE
        self._msg_at = self._flags_at + n * self._flag_stride
        self.header_bytes = (self._msg_at + n * _MSG_BYTES + PAGE - 1) // PAGE * PAGE
        self.segment_bytes = self.header_bytes + 2 * self.bank_bytes
        self.peers = tuple(j for j in range(n) if j != local_rank)   # the other local ranks
        self._seq = 0        # rounds this rank has entered
        self._known = 0      # every peer is known to have entered this many rounds
        self._next_check = 0.0
        self._fd = -1
        self._mm = None
        self._q = self._hb = self._mem = None
        self._banks: Tuple[Tuple[np.ndarray, ...], ...] = ()
        self._whole: Tuple[np.ndarray, ...] = ()
        self._pidns = seg.pid_namespace()
        self._views: dict = {}
        self._linked = False
        self._connected = self._closed = False
        self._error: Optional[BaseException] = None
        self._want_cma = bool(cma) and _cma.AVAILABLE
        self._probe: Optional[np.ndarray] = None
        self._probed: dict = {}   # local rank -> the pid whose memory the probe read
        self.cma = False   # every rank may read every other's memory (agreed at connect)

    # -- data views ----------------------------------------------------------------------
    def bank(self, bank: int) -> np.ndarray:
        """The whole of bank ``bank`` (0 or 1) as uint8: all ranks' slots back to back."""
        return self._whole[bank]

    def slots(self, bank: int, dtype: np.dtype, count: int) -> Tuple[np.ndarray, ...]:
        """Each rank's slot in ``bank`` as ``count`` elements of ``dtype`` (cached views)."""
        key = (bank, dtype, count)
        views = self._views.get(key)
        if views is None:
            nbytes = count * dtype.itemsize
            views = tuple(s[:nbytes].view(dtype) for s in self._banks[bank])
            if len(self._views) >= 64:
                self._views.pop(next(iter(self._views)))
            self._views[key] = views
        return views

    # slots for a collective's small metadata (counts): the same slots here; a device
    # group (ddl.dataplane.device.ipc_group) keeps them in its host group
    meta_slots = slots

    def close(self) -> None:
        """Leave the group and unmap the segment; idempotent.

        Peers that wait for this rank then raise :class:`~ddl.PeerLostError`. The name is
        removed here if the rendezvous never completed.
        """
        if self._closed:
            return
        self._closed = True
        self._connected = False
        if self._q is not None:
            q = self._q
            w = (self._info_at + self.local_rank * _LINE) // 8 + 1
            if q[w] == _ATTACHED:
                q[w] = _CLOSED
            self._wake_everyone()
        if self._fd >= 0:
            self._unlink()
        self._views.clear()
        self._banks = self._whole = ()
        self._mem = None
        if self._q is not None:
            self._q.release()
            self._hb.release()
            self._q = self._hb = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass    # a view lives on (e.g. in a traceback): unmapped when it goes
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ShmGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
