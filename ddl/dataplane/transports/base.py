"""The transport interface: moves bytes between two ranks of one job.

A transport knows every peer by global rank. Every blocking method takes a
``deadline`` (``time.monotonic()`` value) and raises :class:`~ddl.DDLTimeoutError` past
it; it also calls the ``abort_check`` given at construction at least every
``poll_interval`` seconds, so a fatal job error (a peer lost elsewhere) interrupts a
transfer at once. A broken connection raises :class:`~ddl.PeerLostError` naming the peer.

Transports move bytes only; which data path carries a collective is chosen by the
backends (:mod:`ddl.dataplane.backends`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Group:
    """The members of one collective: sorted global ranks and this process's index."""

    ranks: Tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.index]

    def peer(self, index: int) -> int:
        """Global rank of member ``index`` (taken modulo the group size)."""
        return self.ranks[index % len(self.ranks)]

    @classmethod
    def of(cls, ranks: Sequence[int], my_rank: int) -> "Group":
        ranks = tuple(sorted(int(r) for r in ranks))
        return cls(ranks, ranks.index(my_rank))


AbortCheck = Callable[[], None]


class Transport(abc.ABC):
    """Point-to-point byte movement between this rank and its peers."""

    name: str = "abstract"

    @abc.abstractmethod
    def send(self, peer: int, buf: memoryview, deadline: float) -> None:
        """Send all of ``buf`` to ``peer``."""

    @abc.abstractmethod
    def recv_into(self, peer: int, buf: memoryview, deadline: float) -> None:
        """Receive exactly ``len(buf)`` bytes from ``peer`` into ``buf``."""

    @abc.abstractmethod
    def sendrecv(self, send_peer: int, send_buf: memoryview, recv_peer: int,
                 recv_buf: memoryview, deadline: float,
                 on_recv: Optional[Callable[[int, int], None]] = None,
                 chunk: int = 0) -> None:
        """Send ``send_buf`` to ``send_peer`` while receiving ``recv_buf`` from ``recv_peer``.

        Both directions progress together, so a ring of ranks calling this never
        deadlocks. If ``on_recv`` is given, it is called as ``on_recv(start, stop)`` each
        time another ``chunk`` bytes of ``recv_buf`` (or the tail) have arrived, in
        order, letting the caller reduce a chunk while the next one is in flight.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection; idempotent."""
