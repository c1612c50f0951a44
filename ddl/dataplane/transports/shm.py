"""Shared-memory transport: the ranks of one host meet in one segment of ``/dev/shm``.

A :class:`ShmGroup` is this process's membership of one such meeting: ``local_size``
processes, each knowing its ``local_rank``. The algorithms that move and reduce bytes
through it live in :mod:`ddl.dataplane.algorithms.shm_collectives`; this module owns the segment,
the rendezvous, the synchronization and the failure handling.

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

import errno
import hmac
import os
import sys
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ddl.core import faults as _faults
from ddl.core.auth import mac
from ddl.core.cpus import usable_cpus
from ddl.core.dtypes import BFLOAT16, ReduceOp
from ddl.core.errors import DDLTimeoutError, MismatchError, PeerLostError, ShutdownError
from ddl.dataplane.transports import _cma, _futex
from ddl.dataplane.transports import _shm_segment as seg
from ddl.dataplane.transports._shm_segment import (SHM_DIR, SharedMemoryError, cleanup_job_segments,
                                                   segment_name, segment_prefix)
from ddl.dataplane.transports.base import AbortCheck

DEFAULT_SLOT_BYTES = 1 << 20       # per local rank and bank: 2 MiB of /dev/shm per local rank
MAX_LOCAL_SIZE = 256
PAGE = 4096

# Segment layout. Header words (u64): 0 magic (written last by the creator), 1 version,
# 2 local_size, 3 data bytes, 4 creator pid, 5 abort (0, or local rank + 1 of the first
# rank that failed); bytes 48..80 the header's MAC. Then, per local rank: a 64-B line with
# its round counter and 3 descriptor words per bank (written by it alone); a 64-B line
# with pid, state, pid namespace, the address of its cross-memory probe and its verdict
# on the others' (_CMA_OK or _CMA_NO); its "sleeping on you" flags (one byte per waiter); a
# message saying why it failed. Then the data: bank 0, bank 1, each one slot per rank.
_MAGIC = int.from_bytes(b"DDLSHM01", "little")
_VERSION = 2
_ABORT = 5
_MAC_AT = 48
_SEQ_AT = 128
_LINE = 64
_MSG_BYTES = 256
_ATTACHED, _CLOSED, _FAILED = 1, 2, 3
_CMA_OK, _CMA_NO = 1, 2
_LOW = 4 if sys.byteorder == "big" else 0   # offset of a counter's low 32-bit word

__all__ = ["ShmGroup", "SharedMemoryError", "available", "cleanup_job_segments",
           "segment_name", "segment_prefix", "descriptor", "describe", "SHM_DIR",
           "DEFAULT_SLOT_BYTES"]


class _ThreadPolicy(threading.local):
    """How this thread waits: a background thread (ddl's engine or cycle thread, while
    the program computes) never spins, since a spin holds the GIL and a core that the
    program's own threads need; it yields, then sleeps."""

    background = False


_thread = _ThreadPolicy()
_BACKGROUND_YIELDS = range(30)


def run_in_background() -> None:
    """Mark the calling thread as a background thread for its lifetime (see
    :class:`_ThreadPolicy`)."""
    _thread.background = True


def available(shm_dir: str = SHM_DIR) -> bool:
    """Whether this process can use shared-memory groups (Linux, futexes, ``shm_dir``)."""
    return (_futex.AVAILABLE and os.path.isdir(shm_dir)
            and (_futex.STRONG_ORDER or _futex.HAVE_FENCE))


KINDS = ("", "allreduce", "allgatherv", "broadcast", "reducescatter", "barrier", "alltoallv",
         "cycle", "allreduce/one_round", "allreduce/cross_memory", "connect")


def descriptor(kind: str, nbytes: int, dtype: Optional[np.dtype] = None, op: int = 0,
               root: int = -1, counts: Sequence[int] = ()) -> Tuple[int, int, int]:
    """Three integers that describe one collective call, compared across local ranks."""
    char, size = (ord(dtype.char), dtype.itemsize) if dtype is not None else (0, 0)
    word = (KINDS.index(kind) | (int(op) & 0xFF) << 8 | char << 16 | (size & 0xFF) << 24
            | (root + 1) << 32)
    return word, nbytes, hash(tuple(int(c) for c in counts)) & 0xFFFFFFFFFFFFFFFF


def describe(desc: Sequence[int]) -> str:
    """``descriptor`` in words, for mismatch messages."""
    word, nbytes, counts = desc
    kind, op, char = word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF
    parts = [f"{nbytes} bytes"]
    if char:
        try:
            name = BFLOAT16.name if chr(char) == BFLOAT16.char else np.dtype(chr(char)).name
        except TypeError:
            name = f"dtype {chr(char)!r}"
        parts[0] += f" of {name}"
    if op:
        parts.append(f"op {ReduceOp(op).name if op in ReduceOp._value2member_map_ else op}")
    if word >> 32:
        parts.append(f"root {(word >> 32) - 1}")
    if counts != descriptor("", 0)[2]:
        parts.append(f"counts #{counts:016x}")
    name = KINDS[kind] if kind < len(KINDS) else f"kind {kind}"
    return f"{name}({', '.join(parts)})"


def _no_abort() -> None:
    return None


class ShmGroup:
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

    # -- rendezvous ----------------------------------------------------------------------
    def connect(self, deadline: float) -> "ShmGroup":
        """Create (local rank 0) or open the segment and wait until every rank attached.

        Raises :class:`~ddl.DDLTimeoutError` naming the ranks that did not attach by
        ``deadline``, :class:`SharedMemoryError` if the segment cannot be made or trusted.
        """
        if self._connected or self._closed:
            raise RuntimeError("ShmGroup.connect() may be called once, before close()")
        if self.size == 1:
            self._connected = True
            return self
        try:
            if _faults.ACTIVE is not None: _faults.hit("shm.attach")
            if self.local_rank == 0:
                self._create()
            else:
                self._attach(deadline)
            q, i = self._q, self.local_rank
            info = (self._info_at + i * _LINE) // 8
            if self._want_cma:
                self._probe = np.frombuffer(self._probe_token(i), np.uint8).copy()
                q[info + 3] = self._probe.ctypes.data
            q[info], q[info + 2], q[info + 1] = os.getpid(), self._pidns, _ATTACHED
            self.publish()
            self.wait_all(deadline, "connect")
            self._unlink()       # everyone is in: the name is no longer needed
            q[info + 4] = _CMA_OK if self._probe_peers() else _CMA_NO
            self.publish()
            self.wait_all(deadline, "cross-memory probe at connect")
            self.cma = all(self._q[(self._info_at + j * _LINE) // 8 + 4] == _CMA_OK
                           for j in range(self.size))
            self._probe = None
            self._connected = True
        except BaseException as exc:
            self.fail(exc)
            self.close()
            raise
        return self

    def _probe_token(self, j: int) -> bytes:
        return mac(self._key, b"shm cma probe", self.path.encode(), str(j).encode())[:16]

    def _probe_peers(self) -> bool:
        """Whether this rank can read each peer's probe (same pid namespace, allowed)."""
        if not self._want_cma or not self._pidns:
            return False
        got = np.zeros(16, np.uint8)
        for j in self.peers:
            pid, _, ns = self._info(j)
            address = self._q[(self._info_at + j * _LINE) // 8 + 3]
            if ns != self._pidns or not address:
                return False
            try:
                _cma.read(pid, address, got)
            except OSError:
                return False
            if got.tobytes() != self._probe_token(j):
                return False
            self._probed[j] = pid
        return True

    def _create(self) -> None:
        self._fd = seg.create(self.path, self.segment_bytes, self.job_id)
        self._linked = True
        self._map()
        q = self._q
        q[1], q[2], q[3], q[4] = _VERSION, self.size, 2 * self.bank_bytes, os.getpid()
        self._hb[_MAC_AT:_MAC_AT + 32] = self._header_mac()
        if not _futex.STRONG_ORDER:
            _futex.fence()
        q[0] = _MAGIC

    def _attach(self, deadline: float) -> None:
        backoff = [0.001]

        def pause() -> None:   # the segment has no futex to sleep on yet: back off
            now = time.monotonic()
            if now >= self._next_check:
                self._abort_check()
                self._next_check = now + self._poll
            if now >= deadline:
                raise DDLTimeoutError(f"local rank {self.local_rank} waited in vain for local "
                                      f"rank 0 to create shared-memory segment {self.path}",
                                      op="connect")
            time.sleep(min(backoff[0], max(deadline - now, 0.0)))
            backoff[0] = min(backoff[0] * 2, 0.02)

        self._fd = seg.open_existing(self.path, self.segment_bytes, pause,
                                     f"local rank {self.local_rank} (local_size {self.size}, "
                                     f"slot_bytes {self.slot_bytes})")
        self._linked = True
        self._map()
        while self._q[0] != _MAGIC:
            pause()
        q = self._q
        if (q[1], q[2], q[3]) != (_VERSION, self.size, 2 * self.bank_bytes) or not (
                hmac.compare_digest(bytes(self._hb[_MAC_AT:_MAC_AT + 32]), self._header_mac())):
            raise SharedMemoryError(
                f"shared-memory segment {self.path} has a header for version {q[1]}, "
                f"local_size {q[2]}, {q[3]} data bytes that does not match local rank "
                f"{self.local_rank}'s group (or was not made with this job's secret)")

    def _header_mac(self) -> bytes:
        return mac(self._key, b"ddl-shm-header-v1", self.path.encode(),
                   self.size.to_bytes(4, "big"), (2 * self.bank_bytes).to_bytes(8, "big"))

    def _map(self) -> None:
        self._mm = seg.map_segment(self._fd, self.segment_bytes)
        self._mem = np.frombuffer(self._mm, dtype=np.uint8)
        self._hb = memoryview(self._mm)[:self.header_bytes]
        self._q = self._hb.cast("Q")
        base = self._mem.ctypes.data
        self._addrs = tuple(base + _SEQ_AT + j * _LINE + _LOW for j in range(self.size))
        self._seq_idx = tuple((_SEQ_AT + j * _LINE) // 8 for j in range(self.size))
        me = self._flags_at + self.local_rank * self._flag_stride
        self._my_flags = tuple(range(me // 8, (me + self.size + 7) // 8))
        h, s, n = self.header_bytes, self.slot_bytes, self.size
        self._banks = tuple(tuple(self._mem[h + (b * n + j) * s:h + (b * n + j + 1) * s]
                                  for j in range(n)) for b in (0, 1))
        self._whole = tuple(self._mem[h + b * self.bank_bytes:h + (b + 1) * self.bank_bytes]
                            for b in (0, 1))

    def _unlink(self) -> None:
        """Remove the name if it is still this segment's (never a newer group's)."""
        if self._linked:
            self._linked = False
            seg.unlink_if_same(self.path, self._fd)

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

    def read_peer(self, j: int, address: int, dst: np.ndarray, deadline: float,
                  what: str) -> None:
        """Copy ``dst.nbytes`` bytes from ``address`` in local rank ``j``'s memory into
        ``dst`` (1-D uint8) with cross-memory attach (only where :attr:`cma`).

        The caller must know the range stays valid until it says it is done (a later
        round); a failed read raises :class:`~ddl.PeerLostError` naming the peer.
        """
        pid = self._probed[j]
        step = _cma.PIECE_BYTES
        for a in range(0, dst.nbytes, step):
            if self._q[_ABORT]:
                raise self._aborted(what)
            if time.monotonic() >= deadline:
                raise DDLTimeoutError(
                    f"shared-memory {what} on local rank {self.local_rank} passed its deadline "
                    f"reading {self._who(j)}'s memory ({a} of {dst.nbytes} bytes read)",
                    op=what, timeout=0.0)
            try:
                _cma.read(pid, address, dst, a, min(dst.nbytes, a + step))
            except OSError as exc:
                if self._q[_ABORT]:
                    raise self._aborted(what) from exc
                self._check_alive(j, what)
                if exc.errno == errno.ESRCH:   # exiting: a zombie still passes pid_alive
                    raise PeerLostError(
                        f"shared-memory {what} on local rank {self.local_rank}: "
                        f"{self._who(j)} died (its process is exiting or gone)",
                        rank=self._global(j), host=self.host_key, pid=pid,
                        cause="process exited") from exc
                raise PeerLostError(f"shared-memory {what} on local rank {self.local_rank}: "
                                    f"reading {self._who(j)}'s memory failed: {exc}",
                                    rank=self._global(j), host=self.host_key, pid=pid,
                                    cause=str(exc)) from exc
        # the owner failed (and may have freed the range) meanwhile: its state says so
        # first, then the group's abort word
        if self._info(j)[1] == _FAILED or self._q[_ABORT]:
            if self._q[_ABORT]:
                raise self._aborted(what)
            raise PeerLostError(f"shared-memory {what} on local rank {self.local_rank}: "
                                f"{self._who(j)} failed while this rank read its memory",
                                rank=self._global(j), host=self.host_key, pid=pid,
                                cause="failed")

    # -- rounds --------------------------------------------------------------------------
    @property
    def round(self) -> int:
        """Rounds this rank has entered; the current round's bank is ``round % 2``."""
        return self._seq

    def check(self, what: str) -> None:
        """Raise the group's sticky error, or if it is not usable, before a collective."""
        if self._error is not None:
            raise self._error
        if not self._connected:
            if self._closed:
                raise ShutdownError(f"shared-memory {what} on local rank {self.local_rank}: "
                                    f"the group is closed")
            raise RuntimeError(f"shared-memory {what}: call ShmGroup.connect() first")
        if self.size > 1 and self._q[_ABORT]:
            err = self._aborted(what)
            self.fail(err)
            raise err

    def begin(self, deadline: float, what: str) -> int:
        """Start writing for the next round; returns its bank (0 or 1).

        Waits until every peer has entered the current round, so nobody still reads the
        bank that the next round reuses.
        """
        if self._known < self._seq:
            self.wait_all(deadline, what)
        return (self._seq + 1) & 1

    def publish(self, desc: Optional[Tuple[int, int, int]] = None) -> None:
        """Enter the next round: this rank's writes for it are in place.

        ``desc`` describes the collective (three integers) so that the peers can check
        they run the same one; pass it on its first round.
        """
        seq = self._seq = self._seq + 1
        q, k = self._q, self._seq_idx[self.local_rank]
        if desc is not None:
            d = k + 1 + 3 * (seq & 1)
            q[d], q[d + 1], q[d + 2] = desc
        if not _futex.STRONG_ORDER:
            _futex.fence()
        q[k] = seq
        if _futex.HAVE_FENCE:
            _futex.fence()
            for w in self._my_flags:
                if q[w]:
                    break
            else:
                return
        _futex.wake(self._addrs[self.local_rank])

    def wait_all(self, deadline: float, what: str,
                 desc: Optional[Tuple[int, int, int]] = None) -> None:
        """Wait until every peer has entered this rank's current round."""
        target, q = self._seq, self._q
        for j in self.peers:
            if q[self._seq_idx[j]] < target:
                self._wait(j, target, deadline, what)
            if desc is not None:
                self._check_desc(j, target, desc, what)
        self._known = target
        if not _futex.STRONG_ORDER:
            _futex.fence()

    def wait_peer(self, j: int, deadline: float, what: str,
                  desc: Optional[Tuple[int, int, int]] = None) -> None:
        """Wait until local rank ``j`` has entered this rank's current round."""
        target = self._seq
        if self._q[self._seq_idx[j]] < target:
            self._wait(j, target, deadline, what)
        if desc is not None:
            self._check_desc(j, target, desc, what)
        if not _futex.STRONG_ORDER:
            _futex.fence()

    def _wait(self, j: int, target: int, deadline: float, what: str) -> None:
        q, k = self._q, self._seq_idx[j]
        background = _thread.background
        for _ in (() if background else self._spin):
            if q[k] >= target:
                return
        for _ in (_BACKGROUND_YIELDS if background else self._yields):
            os.sched_yield()
            if q[k] >= target:
                return
        flag = self._flags_at + j * self._flag_stride + self.local_rank
        state = (self._info_at + j * _LINE) // 8 + 1
        hb, addr = self._hb, self._addrs[j]
        start = time.monotonic()
        while True:
            if q[_ABORT]:
                raise self._aborted(what)
            if q[state] == _CLOSED:
                raise self._closed_peer(j, what)
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + self._poll
                self._abort_check()
                self._check_alive(j, what)
            if now >= deadline:
                raise self._timeout(j, target, what, now - start)
            hb[flag] = 1
            v = q[k]
            if v < target:
                _futex.wait(addr, v, min(deadline, self._next_check) - now)
            hb[flag] = 0
            if q[k] >= target:
                return

    def _check_desc(self, j: int, target: int, desc, what: str) -> None:
        d = self._seq_idx[j] + 1 + 3 * (target & 1)
        theirs = (self._q[d], self._q[d + 1], self._q[d + 2])
        if theirs != tuple(desc):
            mine_s, theirs_s = describe(desc), describe(theirs)
            raise MismatchError(
                f"shared-memory {what}: local ranks disagree: {self._who(self.local_rank)} "
                f"called {mine_s}, {self._who(j)} called {theirs_s}", op=what,
                rank_a=self._global(self.local_rank), value_a=mine_s,
                rank_b=self._global(j), value_b=theirs_s)

    # -- failures ------------------------------------------------------------------------
    def _global(self, j: int) -> int:
        return self.ranks[j] if self.ranks is not None else j

    def _info(self, j: int) -> Tuple[int, int, int]:
        w = (self._info_at + j * _LINE) // 8
        return self._q[w], self._q[w + 1], self._q[w + 2]

    def _who(self, j: int) -> str:
        pid = self._info(j)[0] if self._q is not None else 0
        rank = f"rank {self.ranks[j]}, " if self.ranks is not None else ""
        return f"local rank {j} ({rank}pid {pid or '?'})"

    def _closed_peer(self, j: int, what: str) -> PeerLostError:
        return PeerLostError(f"shared-memory {what} on local rank {self.local_rank}: "
                             f"{self._who(j)} closed the group while this rank waited for it",
                             rank=self._global(j), host=self.host_key, pid=self._info(j)[0],
                             cause="closed")

    def _check_alive(self, j: int, what: str) -> None:
        pid, state, ns = self._info(j)
        if state == _ATTACHED and pid and ns == self._pidns and not seg.pid_alive(pid):
            raise PeerLostError(f"shared-memory {what} on local rank {self.local_rank}: "
                                f"{self._who(j)} died (its process no longer exists)",
                                rank=self._global(j), host=self.host_key, pid=pid,
                                cause="process exited")

    def _aborted(self, what: str) -> PeerLostError:
        j = self._q[_ABORT] - 1
        at = self._msg_at + j * _MSG_BYTES
        cause = bytes(self._hb[at:at + _MSG_BYTES]).rstrip(b"\0").decode("utf-8", "replace")
        return PeerLostError(f"shared-memory {what} on local rank {self.local_rank}: "
                             f"{self._who(j)} abandoned the group: {cause}",
                             rank=self._global(j), host=self.host_key,
                             pid=self._info(j)[0], cause=cause)

    def _timeout(self, j: int, target: int, what: str, waited: float) -> DDLTimeoutError:
        if what == "connect":
            missing = [p for p in range(self.size) if self._info(p)[1] != _ATTACHED]
            return DDLTimeoutError(
                f"shared-memory rendezvous of job {self.job_id} on host {self.host_key}: "
                f"local ranks {missing} of {self.size} did not attach to {self.path}",
                op=what, timeout=waited)
        return DDLTimeoutError(
            f"shared-memory {what} on local rank {self.local_rank} passed its deadline after "
            f"waiting {waited:.3f} s for {self._who(j)} to enter round {target} (it is at "
            f"round {self._q[self._seq_idx[j]]})", op=what, timeout=waited)

    def last_round(self, deadline: float, what: str) -> bool:
        """A last round of every member as they leave, so that what it guards (a device
        segment the peers map) is released only once none of them uses it: True once
        each has entered it, False at once where the group failed, and when a peer fails,
        dies or closes without entering it, or is still out at ``deadline``. The
        process's abort check is no longer asked (the process is leaving: it would say
        so); the job's abort word and the peers' liveness are. The group takes no round
        after this one."""
        if self.size == 1:
            return True
        if self._error is not None or not self._connected:
            return False
        self._abort_check = _no_abort
        try:
            self.begin(deadline, what)
            self.publish()
            self.wait_all(deadline, what)
            return True
        except Exception:   # (a peer that entered the round and closed at once counts)
            q, target = self._q, self._seq
            return all(q[self._seq_idx[j]] >= target for j in self.peers)

    def fail(self, exc: BaseException) -> None:
        """Break the group after ``exc`` interrupted a collective; tell every peer why."""
        if self._error is None:
            self._error = exc
        if self._q is None or self.size == 1:
            return
        q, i = self._q, self.local_rank
        q[(self._info_at + i * _LINE) // 8 + 1] = _FAILED
        if not q[_ABORT]:
            text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:_MSG_BYTES - 1]
            at = self._msg_at + i * _MSG_BYTES
            self._hb[at:at + _MSG_BYTES] = text.ljust(_MSG_BYTES, b"\0")
            q[_ABORT] = i + 1
        self._wake_everyone()

    def _wake_everyone(self) -> None:
        if _futex.HAVE_FENCE or not _futex.STRONG_ORDER:
            _futex.fence()
        for addr in self._addrs:
            _futex.wake(addr)

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
