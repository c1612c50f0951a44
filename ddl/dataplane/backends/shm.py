"""The shared-memory backend: collectives whose members all run on this host.

:class:`ShmBackend` runs :mod:`ddl.dataplane.algorithms.shm_collectives` on a connected
:class:`~ddl.dataplane.transports.shm.ShmGroup` that :class:`ShmGroups` makes on first use, one per
member set, while every member executes the same response, so they all connect at the
same point of the global order. ``DDL_TRANSPORT`` forces the choice: ``auto`` (shared
memory when it can), ``shm`` (an error where it cannot), ``tcp`` (never).
``DDL_SHM_ALLREDUCE_ALGORITHM`` picks the allreduce algorithm.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ddl.core import faults as _faults
from ddl.core.cache_signature import INLINE_AREA_BYTES, LONE_MIN_BYTES
from ddl.core.errors import ConfigError
from ddl.dataplane.algorithms._buffers import even_offsets
from ddl.dataplane.backends.base import Backend, CycleChannel, CycleSetup, DataPlane
from ddl.dataplane.transports.base import Group
from ddl.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from ddl.dataplane.transports.shm import ShmGroup

_SLOT_BYTES = 1 << 20  # per rank and bank: the chunk one rank moves per round
_VOTES_ALIGN = 64


class ShmGroups:
    """Shared-memory groups of this rank, by member ranks."""

    def __init__(self, mode: str, job_id: str, secret: bytes, rank: int,
                 hosts: Mapping[int, str], abort_check: Callable[[], None],
                 tag_prefix: str = "g", cma: bool = True):
        self.mode = mode
        self.cma = cma
        self._tag_prefix = tag_prefix  # a second set of groups (the cycles') gets its own
        self._job_id = job_id
        self._secret = secret
        self._rank = rank
        self._hosts = dict(hosts)
        self._abort_check = abort_check
        self._groups: Dict[Tuple[int, ...], object] = {}
        self._lock = threading.Lock()
        self._available: Optional[bool] = None

    def _shm_possible(self) -> bool:
        if self._available is None:
            from ddl.dataplane.transports import shm
            self._available = shm.available()
        return self._available

    def usable(self) -> bool:
        """Whether shared memory may carry anything (DDL_TRANSPORT, the machine)."""
        return self.mode != "tcp" and self._shm_possible()

    def supports(self, group: Group) -> bool:
        """Whether ``group``'s collectives run in shared memory: two or more members, all
        on this host. Raises ConfigError where DDL_TRANSPORT=shm cannot be honoured."""
        if self.mode == "tcp" or group.size < 2:
            return False
        host = self._hosts.get(self._rank)
        if any(self._hosts.get(r) != host for r in group.ranks):
            if self.mode == "shm" and len(set(self._hosts.values())) == 1:
                raise ConfigError("DDL_TRANSPORT=shm but the members of this collective are "
                                  "on different hosts", variable="DDL_TRANSPORT", value="shm")
            return False
        if not self._shm_possible():
            if self.mode == "shm":
                raise ConfigError("DDL_TRANSPORT=shm but shared memory is not available on "
                                  "this machine (Linux futexes and /dev/shm are needed)",
                                  variable="DDL_TRANSPORT", value="shm")
            return False
        return True

    def twin(self, tag_prefix: str, abort_check: Callable[[], None]) -> "ShmGroups":
        """A second, separate set of groups for the same ranks (the cycles' own)."""
        return ShmGroups(self.mode, self._job_id, self._secret, self._rank, self._hosts,
                         abort_check, tag_prefix=tag_prefix, cma=self.cma)

    def get(self, group: Group, deadline: float):
        """The connected shared-memory group for ``group`` (one :meth:`supports`)."""
        host = self._hosts.get(self._rank)
        with self._lock:
            found = self._groups.get(group.ranks)
        if found is not None:
            return found
        from ddl.dataplane.transports.shm import ShmGroup

        tag = self._tag_prefix + hashlib.sha256(repr(group.ranks).encode()).hexdigest()[:16]
        made = ShmGroup(self._job_id, self._secret, host or "", group.index, group.size,
                        _SLOT_BYTES, self._abort_check, tag=tag,
                        ranks=group.ranks, cma=self.cma).connect(deadline)
        with self._lock:
            self._groups[group.ranks] = made
        return made

    def close(self) -> None:
        """Leave every group (idempotent)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for g in groups:
            g.close()  # type: ignore[attr-defined]


class FixedShmGroup:
    """Every collective on one given shared-memory group (the cache cycles' own, of every
    rank of a job on one host)."""

    def __init__(self, group):
        self.group = group

    def usable(self) -> bool:
        return True

    def supports(self, group: Group) -> bool:
        return True

    def get(self, group: Group, deadline: float):
        return self.group

    def close(self) -> None:
        self.group.close()


_SHARES = 1 << 40   # a lone tag's flag (above any cache slot): reduce_scatter's order


def _lone_at(capacity: int) -> int:
    """Where the lone place starts in a cycle slot (after the tag word that follows the
    votes); see :class:`ShmVotes`."""
    votes = -(-(capacity + 1) // _VOTES_ALIGN) * _VOTES_ALIGN
    return INLINE_AREA_BYTES + votes + _VOTES_ALIGN


def segment_slot_bytes(capacity: int) -> int:
    """The slot size a cycle group needs for ``capacity`` cache slots: the inline area,
    one vote per slot (slot 0 marks flush cycles), the lone call's tag and at least
    ``LONE_MIN_BYTES`` of lone place, in whole pages."""
    page = 4096
    return max(1 << 20, -(-(_lone_at(capacity) + LONE_MIN_BYTES) // page) * page)


class ShmVotes:
    """A cycle's round on a shared-memory group of every rank: votes and inline inputs
    travel together (see :mod:`ddl.runtime.cycles`).

    Each rank's slot holds, in order: the inline area (``INLINE_AREA_BYTES``, fixed places
    the leader gave), the votes, a tag word, and the *lone place* (the rest of the slot,
    at least ``LONE_MIN_BYTES``). A rank may put the input of one more ready-to-vote call
    with no inline place in its lone place, tagging it with the call's slot (and, for an
    allreduce, the order its completion reduces in: :meth:`_lone_tag`): when every
    rank's tag names the same slot (:attr:`lone`, agreed from the round itself, so the
    same on every rank) and the vote makes it ready, that call completes from the round
    as an inline one does, with no collective of its own. Which call a rank puts there
    is the caller's choice (:mod:`ddl.runtime.cycles`); a rank that puts another, or
    none, makes the call run as a collective, as before."""

    inline = True

    def __init__(self, group: ShmGroup, capacity: int, rank: int,
                 algorithm: Callable[[], str] = lambda: "auto"):
        if group.slot_bytes < segment_slot_bytes(capacity):
            raise ValueError(f"cycle group slots of {group.slot_bytes} bytes are too small "
                             f"for {capacity} cache slots")
        self.group = group
        self.rank = rank
        self.outcome = np.zeros(capacity + 1, dtype=np.int8)
        self._votes_at = INLINE_AREA_BYTES
        self._tag_at = _lone_at(capacity) - _VOTES_ALIGN
        self.lone_at = _lone_at(capacity)  # byte offset of the lone place in a slot
        self.lone_room = group.slot_bytes - self.lone_at
        self._tags: Tuple[np.ndarray, ...] = ()  # the last round's, every rank's
        self._algorithm = algorithm  # DDL_SHM_ALLREDUCE_ALGORITHM as it is now
        from ddl.dataplane.algorithms.shm_collectives import allreduce_algorithm
        from ddl.dataplane.transports.shm import descriptor
        self._allreduce_algorithm = allreduce_algorithm
        self._desc = descriptor("cycle", capacity + 1)
        self._bank_views: Dict[int, tuple] = {}

    def lone_fits(self, call) -> bool:
        """Whether the cached ``call`` (one with no inline place) may ride in the lone
        place: any cacheable call that fits it (an allgather or alltoall: every rank's
        input), and for an allreduce one that the group would run through the segment
        (:meth:`_lone_tag`)."""
        return self._lone_tag(call) != 0

    def _lone_tag(self, call) -> int:
        """What a rank writes in its tag for ``call`` in the lone place, or 0 where it may
        not ride there. Completing an allreduce from the round gives the bits of its
        collective: ``one_round`` reduces in rank order, as the completion does; for
        ``reduce_scatter`` (where ``auto`` chose it: a forced one runs as itself) each rank
        reduces its share with its own bytes first, so the tag carries :data:`_SHARES`,
        the completion follows that order (:meth:`lone_shares`), and ranks whose settings
        chose differently write different tags and run the call as its collective, whose
        descriptors name the difference. (Even at 2 ranks the orders differ in bits:
        ``max(-0.0, +0.0)`` is the first operand, and so is a sum of two NaNs' payload.)"""
        if call.firsts:   # an allgather, an alltoall: each rank's input in its own place
            return call.slot if max(call.firsts) * call.row_bytes <= self.lone_room else 0
        if call.op == pb.REDUCESCATTER:
            # its collective reduces each block with its owner's bytes first, then the
            # others' in rank order; the completion does the same
            return call.slot if call.nbytes <= self.lone_room else 0
        if call.nbytes > self.lone_room:   # an allreduce, a broadcast
            return 0
        if call.op != pb.ALLREDUCE:
            return call.slot
        setting = self._algorithm()
        algorithm = self._allreduce_algorithm(call.nbytes, self.group, None, setting)
        if algorithm == "one_round":
            return call.slot
        if algorithm != "reduce_scatter" or setting != "auto":   # forced: run as such
            return 0
        if call.ufunc is None:   # Adasum combines every rank's bytes in rank order
            return call.slot
        return call.slot | _SHARES

    def lone_shares(self, call) -> Sequence[int]:
        """The share boundaries (wire elements) in whose order the call that the last
        round carried in the lone place completes, or ``()`` for rank order."""
        if not self._agreed_tag() & _SHARES:
            return ()
        return even_offsets(call.plan.wire_count(call.count), self.group.size)

    def exchange(self, vote: np.ndarray, inline: List[Tuple[Any, Any]],
                 deadline: float, lone: Optional[Tuple[Any, Any]] = None
                 ) -> Tuple[np.ndarray, ...]:
        """Write ``vote``, the ``inline`` calls' inputs (``(array, call)`` pairs: the
        cache's :class:`~ddl.runtime.cache.CachedCall` with its place and reduction plan)
        and the ``lone`` call's (one such pair, or None), wait for every rank, leave the
        minimum vote per slot in ``outcome`` (and what :attr:`lone` reads);
        returns every rank's slot (as bytes), to be read before this group's next
        round."""
        g = self.group
        if _faults.ACTIVE is not None: _faults.hit("shm.step")
        try:
            bank = g.begin(deadline, "cache cycle")
            slots, votes, tags = self._views(bank)
            mine = slots[g.index]
            np.copyto(votes[g.index], vote)
            for array, call in inline:
                self._write(mine, call.inline, array, call)
            tag = 0
            if lone is not None:
                self._write(mine, self.lone_at, lone[0], lone[1])
                tag = self._lone_tag(lone[1])
            tags[g.index][0] = tag
            g.publish(self._desc)
            g.wait_all(deadline, "cache cycle", self._desc)
        except BaseException as exc:
            g.fail(exc)
            raise
        out = self.outcome
        np.minimum(votes[0], votes[1], out=out)
        for j in range(2, len(votes)):
            np.minimum(out, votes[j], out=out)
        self._tags = tags
        return slots

    @property
    def lone(self) -> int:
        """The slot whose call the last round carried in every rank's lone place, or 0
        (the ranks put different ones there, or none); the same on every rank. Read it
        before the group's next round."""
        return self._agreed_tag() & ~_SHARES

    def _agreed_tag(self) -> int:
        """The last round's lone tag if every rank wrote the same one, else 0."""
        tags = self._tags
        first = int(tags[0][0]) if tags else 0
        for t in tags[1:]:
            if t[0] != first:
                return 0
        return first

    def _write(self, mine: np.ndarray, at: int, array, call) -> None:
        """Put ``call``'s input at byte ``at`` of this rank's slot: packed as its
        reduction plan says (an allreduce, a reducescatter), as it is (an allgather, an
        alltoall), or the root's bytes (a broadcast)."""
        if call.plan is not None:   # an allreduce, a reducescatter
            call.plan.pack(array, mine[at:at + call.nbytes].view(call.plan.wire))
        elif call.op != pb.BROADCAST or call.root_rank == self.rank:
            # an allgather's rows, an alltoall's whole input; a broadcast's root's
            np.copyto(mine[at:at + call.nbytes].view(call.dtype), array.reshape(-1))

    def abandon(self) -> None:
        """The job failed: nothing to do, a failing shared-memory round already told every
        rank (``ShmGroup.fail``)."""

    def _views(self, bank: int) -> Tuple[Tuple[np.ndarray, ...], ...]:
        """Every rank's slot of ``bank`` as bytes, its votes as int8 and its lone tag as
        one int64."""
        views = self._bank_views.get(bank)
        if views is None:
            g, at, nvotes, tag = self.group, self._votes_at, len(self.outcome), self._tag_at
            slots = g.slots(bank, np.dtype(np.uint8), g.slot_bytes)
            views = self._bank_views[bank] = (
                slots, tuple(s[at:at + nvotes].view(np.int8) for s in slots),
                tuple(s[tag:tag + 8].view(np.int64) for s in slots))
        return views


# the Timeline's algorithm of the collectives that have one
_ALGORITHMS = {pb.ALLGATHER: "banks", pb.BROADCAST: "banks", pb.ALLTOALL: "parts",
               pb.REDUCESCATTER: "reduce_scatter"}


class ShmBackend(Backend):
    """Shared memory among members on this host
    (:mod:`ddl.dataplane.algorithms.shm_collectives`)."""

    name = "shm"

    def __init__(self, plane):
        super().__init__(plane)
        from ddl.dataplane.algorithms import shm_collectives
        self._c = shm_collectives
        self._groups = plane.shm_groups

    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        return self._groups.supports(group)

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        if op == pb.ALLREDUCE:
            # read per call: the autotuner may change it between responses (Config.tune)
            return self._c.allreduce_algorithm(nbytes, self._groups.get(group, deadline),
                                               algorithm=self.config.shm_allreduce_algorithm)
        return _ALGORITHMS[op]

    def allreduce(self, buf, op, group, deadline, src=None) -> None:
        self._c.allreduce(buf, op, self._groups.get(group, deadline), deadline, src=src,
                          algorithm=self.config.shm_allreduce_algorithm)

    def allgatherv(self, send, out, counts: Sequence[int], group, deadline) -> None:
        self._c.allgatherv(send, out, counts, self._groups.get(group, deadline), deadline)

    def broadcast(self, buf, root_index: int, group, deadline, src=None) -> None:
        self._c.broadcast(buf, root_index, self._groups.get(group, deadline), deadline,
                          src=src)

    def alltoallv(self, send, send_counts, recv, recv_counts, group, deadline) -> None:
        self._c.alltoallv(send, send_counts, recv, recv_counts,
                          self._groups.get(group, deadline), deadline)

    def reducescatter(self, buf: np.ndarray, counts, op, group, deadline, src=None,
                      out=None, pack=None) -> None:
        self._c.reducescatter(buf, counts, op, self._groups.get(group, deadline), deadline,
                              src=src, out=out, pack=pack)

    def cycle_channel(self, setup: CycleSetup) -> Optional[CycleChannel]:
        """Every rank on this host: the cycles vote (and pass small inputs inline) on a
        shared-memory group of their own (:class:`ShmVotes`)."""
        try:
            if not self._groups.supports(setup.world):
                return None
        except ConfigError:
            return None  # DDL_TRANSPORT=shm where it cannot run: the first collective says so
        from ddl.dataplane.transports.shm import ShmGroup

        setup.on_phase("attaching the response cache's shared memory")
        world = setup.world
        group = ShmGroup(setup.job_id, setup.secret, setup.hostname, world.index, world.size,
                         segment_slot_bytes(setup.capacity), setup.abort_check, tag="cycles",
                         ranks=world.ranks, cma=self._groups.cma).connect(setup.deadline)
        fixed = FixedShmGroup(group)
        plane = DataPlane(self.plane.rank, self.config, self.plane.transport, fixed,
                          self.plane.hosts, abort_check=setup.abort_check)
        config = self.config
        votes = ShmVotes(group, setup.capacity, world.index,
                         lambda: config.shm_allreduce_algorithm)
        return CycleChannel(votes, plane,
                            uses_transport=False, close=fixed.close)
