"""The cross-memory attach half of a shared-memory group: the probe at connect that
decides :attr:`ShmGroup.cma <ddl.dataplane.transports.shm.ShmGroup.cma>`, and the read of
a range straight out of a peer's memory (:meth:`read_peer`) with the group's deadline,
abort and liveness checks (the design note is :mod:`ddl.dataplane.transports.shm`'s).
"""

from __future__ import annotations

import errno
import time

import numpy as np

from ddl.core.auth import mac
from ddl.core.errors import DDLTimeoutError, PeerLostError
from ddl.dataplane.transports import _cma
from ddl.dataplane.transports._shm_layout import _ABORT, _FAILED, _LINE


class _CrossMemory:
    """Cross-memory attach for a :class:`~ddl.dataplane.transports.shm.ShmGroup` (mixed
    into it)."""

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
