"""The rendezvous half of a shared-memory group: local rank 0 creates the segment and
writes its authenticated header, the others open, check and attach it, everyone maps it
and waits for the rest, and the name is unlinked once all are in (the design note is
:mod:`ddl.dataplane.transports.shm`'s).
"""

from __future__ import annotations

import hmac
import os
import time
from typing import TypeVar

import numpy as np

from ddl.core import faults as _faults
from ddl.core.auth import mac
from ddl.core.errors import DDLTimeoutError
from ddl.dataplane.transports import _futex
from ddl.dataplane.transports import _shm_segment as seg
from ddl.dataplane.transports._shm_layout import (_ATTACHED, _CMA_NO, _CMA_OK, _LINE, _LOW,
                                                  _MAC_AT, _MAGIC, _SEQ_AT, _VERSION)
from ddl.dataplane.transports._shm_segment import SharedMemoryError

_Group = TypeVar("_Group", bound="_Rendezvous")   # the ShmGroup it is mixed into


class _Rendezvous:
    """Connecting a :class:`~ddl.dataplane.transports.shm.ShmGroup` (mixed into it; the
    state it sets up is described in ``ShmGroup.__init__``)."""

    def connect(self: _Group, deadline: float) -> _Group:
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
