"""Calls of several names (a group, a pytree): once one part fails on a rank, the
others never pair (Request.call_id).

Each part of a group call carries its call's number on its rank. When the leader answers
one part with an error, that call has failed on that rank: its parts still pending fail
at once on every member that submitted them (whose own calls then fail the same way),
and parts that come later fail on arrival. So no part waits for names the other ranks
never send (a group of another length), nor pairs with their next call of its name.

:class:`FailedCalls` is mixed into :class:`~ddl.server.leader.Leader`, whose state it
reads and changes: ``_pending``, ``_ready``, and whose helpers it calls
(``_answer_failed``, ``_error_response``, ``_group_error``). The leader calls
:meth:`_note_failure` wherever it answers a request with an error, :meth:`_refuse_failed_call`
first for each request, and :meth:`_withdraw_failed_calls` before each flush.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ddl.core.dtypes import op_name
from ddl.v1 import coordinator_pb2 as pb

from .fusion import ReadyItem
from .validation import LOCAL_ERROR_CHARS, clip, make_error

# failed calls remembered per rank: a part arriving later still fails (a cached part
# sent on when its slot was dropped) unless that many failed since
FAILED_CALLS_KEPT = 256


class FailedCalls:
    """The leader's record of the calls of several names that failed (see the module
    doc)."""

    def __init__(self) -> None:
        # rank -> {call_id: (name, error)} of its failed calls, the newest
        # FAILED_CALLS_KEPT; and those failed since the last flush
        self._failed_calls: Dict[int, Dict[int, Tuple[str, pb.Error]]] = {}
        self._newly_failed: List[Tuple[int, int]] = []

    def _note_failure(self, rank: int, req: pb.Request, err: pb.Error) -> None:
        """``rank`` is answered ``err`` for ``req``: if ``req`` is a part of a call of
        several names, that call failed on ``rank``, and none of its other parts may pair
        (see :meth:`_withdraw_failed_calls`)."""
        if not req.call_id:
            return
        calls = self._failed_calls.setdefault(rank, {})
        if req.call_id in calls:
            return
        calls[req.call_id] = (req.name, err)
        if len(calls) > FAILED_CALLS_KEPT:
            del calls[next(iter(calls))]  # the oldest (dicts keep insertion order)
        self._newly_failed.append((rank, req.call_id))

    def _refuse_failed_call(self, rank: int, req: pb.Request) -> bool:
        """Answer ``req`` at once if its call already failed on ``rank`` at another name
        (True): it must not wait for the others, who may never send it, nor pair with
        their next call of the name."""
        failed = self._failed_calls.get(rank, {}).get(req.call_id)
        if failed is None:
            return False
        if not self._answer_failed((req.process_set_id, req.name), rank, req):
            self._ready.append(ReadyItem(self._error_response(
                req, self._withdrawn_error(rank, req.op, req.name, *failed)), (rank,)))
        return True

    def _withdraw_failed_calls(self) -> None:
        """Fail every pending name that holds a part of a call that failed on its rank
        since the last flush, on every member that submitted it (whose own calls then
        fail too, and so on)."""
        while self._newly_failed:
            failed, self._newly_failed = set(self._newly_failed), []
            for key, p in list(self._pending.items()):
                culprit = next((r for r, q in sorted(p.requests.items())
                                if q.call_id and (r, q.call_id) in failed), None)
                if culprit is None or key not in self._pending:
                    continue
                found = self._failed_calls.get(culprit, {}).get(p.requests[culprit].call_id)
                if found is None:  # forgotten already (FAILED_CALLS_KEPT failed at once)
                    continue
                del self._pending[key]
                self._group_error(p, self._withdrawn_error(culprit, p.op, p.name, *found))

    @staticmethod
    def _withdrawn_error(rank: int, op: int, name: str, failed_at: str,
                         err: pb.Error) -> pb.Error:
        opn = op_name(op)
        why = clip(err.message, LOCAL_ERROR_CHARS)
        return make_error(
            pb.INVALID, f"{opn} '{name}': not run: rank {rank}'s call of which it is a part "
            f"failed at '{failed_at}': {why}", op=opn, name=name, rank_a=rank, value_a=why)

