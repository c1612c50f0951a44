"""Adding and removing process sets at the leader: the members' agreement, the ranks
outside a set that wait to learn its outcome (Horovod's scripts call add_process_set and
remove_process_set on every rank), and add_process_set calls whose ranks are invalid.

:class:`ProcessSets` is mixed into :class:`~ddl.server.leader.Leader`, whose state it
reads and changes (``_sets``, ``_next_set_id``, ``_pending``, ``_ready``, ``_departed``,
``_joined``, ``_bad_adds``, ``_spent_bad_adds``, ``_bad_rounds``, ``_added``, ``_clock``) and whose
helpers it calls (``_add_request``, ``_rank_error``, ``_error_response``,
``_group_error``, ``_fail_departed``, ``_forget_owed``, ``_duplicate``, ``_told``). The leader routes every ADD_PROCESS_SET
request to :meth:`_add_process_set` (one with invalid ranks to :meth:`_fail_add`) and a
non-member's REMOVE_PROCESS_SET to :meth:`_watch`, and calls :meth:`_complete_add` and
:meth:`_remove_set` when the members have agreed.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ddl.core.dtypes import op_name
from ddl.v1 import coordinator_pb2 as pb

from .fusion import ReadyItem
from .pending import Pending, PendingKey
from .validation import LOCAL_ERROR_CHARS, clip, make_error


class ProcessSets:
    """The leader's process-set agreements (see the module doc)."""

    def _add_process_set(self, rank: int, req: pb.Request) -> None:
        listed = list(req.member_ranks)
        members = tuple(sorted(listed))
        problem = ""
        if not listed:
            problem = "the list is empty"
        elif any(r < 0 or r >= self.size for r in listed):
            problem = f"ranks must be in [0, {self.size})"
        elif len(set(listed)) != len(listed):
            problem = "the list has duplicates"
        if problem:
            return self._rank_error(
                rank, req, pb.INVALID,
                f"add_process_set '{req.name}': rank {rank} sent member ranks {listed}: "
                f"{problem}")
        if self._answer_bad_add(rank, req, members):
            return None
        if rank not in members:
            existing = next((i for i, m in self._sets.items() if m == members),
                            self._added.get((req.name, members)))
            return self._watch(("add", req.name, members), rank, req, members,
                               None if existing is None else self._add_response(
                                   req.name, members, existing))
        for other_key, other in list(self._pending.items()):
            if (other.op == pb.ADD_PROCESS_SET and other.name == req.name
                    and other.members != members and set(other.members) & set(members)):
                first = min(other.requests)
                err = make_error(
                    pb.MISMATCH,
                    f"add_process_set '{req.name}': member ranks mismatch: rank {first} sent "
                    f"{list(other.members)}, rank {rank} sent {list(members)}",
                    op="add_process_set", name=req.name, rank_a=first,
                    value_a=str(list(other.members)), rank_b=rank, value_b=str(list(members)))
                del self._pending[other_key]
                self._group_error(other, err)
                self._ready.append(ReadyItem(self._error_response(req, err), (rank,)))
                return None
        self._add_request(("add", req.name, members), rank, req, members)

    def _complete_add(self, p: Pending) -> None:
        set_id = next((i for i, m in self._sets.items() if m == p.members), None)
        if set_id is None:
            set_id = self._next_set_id
            self._next_set_id += 1
            self._sets[set_id] = p.members
        self._added[(p.name, p.members)] = set_id
        for member in p.members:   # in step again: their failed rounds are behind them
            self._spent_bad_adds.pop(member, None)
            if member not in self._bad_adds:
                self._bad_rounds.pop(member, None)
        self._ready.append(ReadyItem(self._add_response(p.name, p.members, set_id),
                                     self._told(p)))

    @staticmethod
    def _add_response(name: str, members: Tuple[int, ...], set_id: int) -> pb.Response:
        return pb.Response(op=pb.ADD_PROCESS_SET, process_set_id=0,
                           tensors=[pb.TensorEntry(name=name)], new_process_set_id=set_id,
                           member_ranks=members, prescale_factor=1.0,
                           postscale_factor=1.0, last_joined_rank=-1)

    def _watch(self, key: PendingKey, rank: int, req: pb.Request, members: Tuple[int, ...],
               done: Optional[pb.Response]) -> None:
        """``rank``, outside the set, called add_process_set or remove_process_set for
        it, as Horovod's scripts do on every rank: it learns the outcome when the members
        agree (``done``: the answer now, when nothing is pending and it is known
        already: the set exists, or is gone). Watching never holds the members up, and a
        stall names the members it waits for."""
        p = self._pending.get(key)
        if p is None and done is not None:
            self._ready.append(ReadyItem(done, (rank,)))
            return None
        if p is None:
            p = self._pending[key] = Pending(req.name, req.op, req.process_set_id, members,
                                             self._clock())
        if rank in p.watchers:
            return self._duplicate(rank, req)
        p.watchers[rank] = req
        gone = sorted(set(members) & self._departed)
        if gone:   # a member left: the agreement can never come
            self._fail_departed(key, gone[0])
        return None

    def _remove_set(self, set_id: int) -> None:
        del self._sets[set_id]
        self._joined.pop(set_id, None)
        self._forget_owed(set(), set_id)
        for key, p in list(self._pending.items()):
            if p.process_set_id == set_id and p.op != pb.ADD_PROCESS_SET:
                del self._pending[key]
                self._group_error(p, make_error(
                    pb.UNKNOWN_PROCESS_SET,
                    f"{op_name(p.op)} '{p.name}': process set {set_id} was removed while this "
                    f"name was pending", op=op_name(p.op), name=p.name))

    def _fail_add(self, rank: int, req: pb.Request) -> None:
        """``rank`` could not even say which set its add_process_set meant (its ranks are
        invalid), so the set's name is unknown. A rank's failed calls are numbered (its
        *rounds*): ranks whose own call of the same round failed too (every rank passed
        the same bad ranks) owe each other nothing; every add_process_set that lists
        ``rank`` and waits for it from an earlier round fails now, and each other rank's
        next one that lists it fails once too (see :meth:`_answer_bad_add`)."""
        text = clip(req.local_error, LOCAL_ERROR_CHARS)
        err = make_error(pb.INVALID, f"add_process_set: rank {rank} {text}",
                         op="add_process_set", name=req.name, rank_a=rank, value_a=text)
        round_ = self._bad_rounds[rank] = self._bad_rounds.get(rank, 0) + 1
        answered = {rank}
        self._spent_bad_adds.pop(rank, None)
        for other, (_, heard, theirs) in [*self._bad_adds.items(),
                                          *self._spent_bad_adds.items()]:
            if other != rank and theirs == round_:   # the same round: nothing owed
                heard.add(rank)
                answered.add(other)
        for key, p in list(self._pending.items()):
            if (p.op == pb.ADD_PROCESS_SET and rank in p.members and rank not in p.requests
                    and any(self._bad_rounds.get(q, 0) < round_
                            for q in [*p.requests, *p.watchers])):
                del self._pending[key]
                self._group_error(p, err)
                answered |= set(p.requests)
        self._bad_adds[rank] = (err, answered, round_)
        self._ready.append(ReadyItem(self._error_response(req, err), (rank,)))

    def _answer_bad_add(self, rank: int, req: pb.Request, members: Tuple[int, ...]) -> bool:
        """Clear ``rank``'s own failed add_process_set; if ``members`` lists a rank whose
        failed round ``rank`` has not had (nor heard of), answer ``rank`` with that error."""
        own = self._bad_adds.pop(rank, None)
        if own is not None:
            self._spent_bad_adds[rank] = own
        mine = self._bad_rounds.get(rank, 0)
        for bad in members:
            entry = self._bad_adds.get(bad) or self._spent_bad_adds.get(bad)
            if (bad != rank and entry is not None and entry[2] > mine
                    and rank not in entry[1]):
                entry[1].add(rank)
                self._ready.append(ReadyItem(self._error_response(req, entry[0]), (rank,)))
                return True
        return False
