"""The round protocol of a shared-memory group: entering a round (publish), waiting for
the peers to enter it (spin, yield, then sleep on a futex, checking the deadline, the
abort word and the peers' liveness), comparing the calls' descriptors, and the last round
as members leave; with the per-thread waiting policy (the design note is
:mod:`ddl.dataplane.transports.shm`'s).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional, Tuple

from ddl.core.errors import MismatchError, ShutdownError
from ddl.dataplane.transports import _futex
from ddl.dataplane.transports._shm_descriptor import describe
from ddl.dataplane.transports._shm_layout import _ABORT, _CLOSED, _LINE


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


def _no_abort() -> None:
    return None


class _Rounds:
    """The rounds of a :class:`~ddl.dataplane.transports.shm.ShmGroup` (mixed into it)."""

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
