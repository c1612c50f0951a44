"""The failure half of a shared-memory group: naming a peer (local and global rank, pid),
the errors for a peer that closed, died, abandoned the group or is late, and breaking
the group so every peer learns why (the design note is
:mod:`ddl.dataplane.transports.shm`'s).
"""

from __future__ import annotations

from typing import Tuple

from ddl.core.errors import DDLTimeoutError, PeerLostError
from ddl.dataplane.transports import _futex
from ddl.dataplane.transports import _shm_segment as seg
from ddl.dataplane.transports._shm_layout import (_ABORT, _ATTACHED, _FAILED, _LINE,
                                                  _MSG_BYTES)


class _Failures:
    """Errors and failure of a :class:`~ddl.dataplane.transports.shm.ShmGroup` (mixed
    into it)."""

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
