"""The leader's negotiation logic: readiness, validation, order, process sets, join,
stalls and departures. Pure logic, no gRPC and no threads: callers hold one lock around
every method and deliver the returned messages.

Every method that changes state returns a list of :data:`Delivery` ``(rank, message)``
pairs, in the order they must be sent. Responses are numbered with one global ``seq``
(strictly increasing from 1 across all process sets) and each rank receives the
responses of its sets in ``seq`` order, one :class:`pb.ResponseList` per flush.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ddl.core.cache_signature import (CACHEABLE_OPS, INLINE_ALIGN, INLINE_AREA_BYTES,
                                      INLINE_MAX_BYTES, cache_signature, inline_bytes)
from ddl.core.config import default
from ddl.core.dtypes import op_name
from ddl.core.fusion import DEFAULT_THRESHOLD
from ddl.v1 import coordinator_pb2 as pb

from .failed_calls import FailedCalls
from .fusion import ReadyItem, flush
from .pending import Delivery, Failed, Peer, Pending, PendingKey
from .process_sets import ProcessSets
from .validation import LOCAL_ERROR_CHARS, clip, make_error, peer_lost_error, validate

if TYPE_CHECKING:
    from .autotune import Tuner

log = logging.getLogger("ddl.server")

_KNOWN_OPS = frozenset(v for v in pb.OpType.values() if v != pb.OP_TYPE_UNSPECIFIED)
# agreements that need every member, joined or not (a joined rank is blocked in join())
_ALL_MEMBERS_OPS = frozenset({pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET})


class Leader(FailedCalls, ProcessSets):
    """Readiness tables and the global order of one job of ``size`` ranks."""

    def __init__(self, size: int, fusion_threshold: int = DEFAULT_THRESHOLD,
                 stall_check_time: float = default("stall_check_time"),
                 stall_shutdown_time: float = default("stall_shutdown_time"),
                 clock: Callable[[], float] = time.monotonic, cache_capacity: int = 0,
                 tuner: Optional["Tuner"] = None):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.fusion_threshold = max(0, int(fusion_threshold))
        self.stall_check_time = stall_check_time
        self.stall_shutdown_time = stall_shutdown_time
        self._clock = clock
        self._peers: Dict[int, Peer] = {}
        self._sets: Dict[int, Tuple[int, ...]] = {0: tuple(range(size))}
        self._next_set_id = 1
        # (add_process_set's name, members) -> the id that call made, kept after a
        # remove: a non-member's call of it may come after the members removed the set
        self._added: Dict[Tuple[str, Tuple[int, ...]], int] = {}
        self._pending: Dict[PendingKey, Pending] = {}
        # names failed by a rank's local error, rounds oldest first, until every member
        # has submitted them
        self._failed: Dict[PendingKey, List[Failed]] = {}
        # rank -> (error, ranks told) of its last add_process_set, which had invalid ranks
        # (and its round: the count of the rank's failed add_process_set calls)
        self._bad_adds: Dict[int, Tuple[pb.Error, Set[int], int]] = {}
        # ... and once the rank sent a valid one since
        self._spent_bad_adds: Dict[int, Tuple[pb.Error, Set[int], int]] = {}
        self._bad_rounds: Dict[int, int] = {}
        self._ready: List[ReadyItem] = []
        FailedCalls.__init__(self)
        self._seq = 0
        # process set -> {rank: name of its JOIN request}, for the join epoch in progress
        self._joined: Dict[int, Dict[int, str]] = {}
        self._departed: Set[int] = set()  # said goodbye
        self._goodbye_reasons: Dict[int, str] = {}
        self._last_response: Dict[int, pb.Response] = {}  # rank -> last one delivered
        self._lost: Set[int] = set()
        self.fatal: Optional[pb.Error] = None  # the abort every rank got, once fatal
        self.cache_capacity = max(0, int(cache_capacity))
        # (name, signature) -> (slot, inline offset or None); neither is ever reused
        self._cache_slots: Dict[tuple, Tuple[int, Optional[int]]] = {}
        self._inline_used = 0  # bytes of the inline area given out
        self._extra: List[Delivery] = []  # messages to send before the next responses
        # the autotuner (server/autotune.py): its setting is stamped on every response,
        # and no call gets a cache slot until it is done (cached calls bypass the leader)
        self.tuner = tuner

    # -- identity ----------------------------------------------------------------------
    def set_peer(self, rank: int, host: str, pid: int) -> None:
        self._peers[rank] = Peer(host, pid)

    def peer(self, rank: int) -> Peer:
        return self._peers.get(rank, Peer())

    def process_sets(self) -> Dict[int, Tuple[int, ...]]:
        return dict(self._sets)

    def pending_names(self) -> List[Pending]:
        return list(self._pending.values())

    def failed_names(self) -> List[Tuple[PendingKey, Failed]]:
        """Failed rounds some members have not submitted yet (see Request.local_error)."""
        return [(key, f) for key, rounds in self._failed.items() for f in rounds]

    # -- requests ----------------------------------------------------------------------
    def submit(self, rank: int, requests: Sequence[pb.Request]) -> List[Delivery]:
        """Record one RequestList of ``rank``; return the responses now ready."""
        if self.fatal is not None:
            return []
        for req in requests:
            self._submit_one(rank, req)
        return self._flush()

    def _submit_one(self, rank: int, req: pb.Request) -> None:
        opn, name, ps_id = op_name(req.op), req.name, req.process_set_id
        if not name:
            return self._rank_error(rank, req, pb.INVALID,
                                    f"{opn}: rank {rank} sent a request with an empty name")
        if req.op not in _KNOWN_OPS:
            return self._rank_error(rank, req, pb.INVALID,
                                    f"{opn} '{name}': rank {rank} sent unknown op {req.op}")
        if req.call_id and self._refuse_failed_call(rank, req):
            return None
        if req.local_error and req.op == pb.ADD_PROCESS_SET:
            return self._fail_add(rank, req)
        if req.local_error and req.op == pb.JOIN:
            # no name the others wait on for this rank (join waits for every rank anyway)
            return self._rank_error(rank, req, pb.INVALID, f"{opn} '{name}': rank {rank} "
                                    f"{clip(req.local_error, LOCAL_ERROR_CHARS)}")
        if req.op == pb.ADD_PROCESS_SET:
            return self._add_process_set(rank, req)
        members = self._sets.get(ps_id)
        if req.op == pb.REMOVE_PROCESS_SET and rank not in (members or req.member_ranks):
            return self._watch((ps_id, name), rank, req, members or tuple(req.member_ranks),
                               None if members is not None else pb.Response(
                                   op=req.op, process_set_id=ps_id, last_joined_rank=-1,
                                   tensors=[pb.TensorEntry(name=name)]))
        if members is None:
            return self._rank_error(
                rank, req, pb.UNKNOWN_PROCESS_SET,
                f"{opn} '{name}': rank {rank} named process set {ps_id}, which does not "
                f"exist; existing process sets: {sorted(self._sets)}")
        if rank not in members:
            return self._rank_error(
                rank, req, pb.INVALID,
                f"{opn} '{name}': rank {rank} is not a member of process set {ps_id} "
                f"(ranks {list(members)})")
        if req.op == pb.JOIN:
            return self._join(rank, req, members)
        if req.op == pb.REMOVE_PROCESS_SET and ps_id == 0:
            return self._rank_error(
                rank, req, pb.INVALID,
                f"remove_process_set '{name}': process set 0 (all ranks) cannot be removed")
        if self._answer_failed((ps_id, name), rank, req):
            return None
        if req.local_error:
            return self._fail_local((ps_id, name), rank, req, members)
        self._add_request((ps_id, name), rank, req, members)

    # -- local errors ------------------------------------------------------------------
    def _fail_local(self, key: PendingKey, rank: int, req: pb.Request,
                    members: Tuple[int, ...]) -> None:
        """``rank`` found its call of this name invalid (Request.local_error): fail the
        name at once for every member that submitted it, and remember it for the others
        (they get the error when they submit it, see :meth:`_answer_failed`)."""
        opn, text = op_name(req.op), clip(req.local_error, LOCAL_ERROR_CHARS)
        p = self._pending.get(key)
        if p is not None and rank in p.requests:
            return self._duplicate(rank, req)
        if p is None:
            p = Pending(req.name, req.op, req.process_set_id, members, self._clock())
        else:
            del self._pending[key]
        p.requests[rank] = req
        err = make_error(pb.INVALID, f"{opn} '{req.name}': rank {rank} {text}", op=opn,
                         name=req.name, rank_a=rank, value_a=text)
        owed = self._required(p) - set(p.requests) - self._departed - self._lost
        if owed:
            self._failed.setdefault(key, []).append(Failed(err, owed))
        self._group_error(p, err)

    def _answer_failed(self, key: PendingKey, rank: int, req: pb.Request) -> bool:
        """If ``rank`` owes a failed round of this name, answer it with that error."""
        rounds = self._failed.get(key, [])
        for i, failed in enumerate(rounds):
            if rank in failed.owed:
                failed.owed.discard(rank)
                if not failed.owed:
                    del rounds[i]
                if not rounds:
                    del self._failed[key]
                self._note_failure(rank, req, failed.error)
                self._ready.append(ReadyItem(self._error_response(req, failed.error), (rank,)))
                return True
        return False

    def _forget_owed(self, gone: Set[int], set_id: Optional[int] = None) -> None:
        """Drop ``gone`` ranks from failed rounds (or every round of process set
        ``set_id``, when it is removed)."""
        for key in list(self._failed):
            rounds = [f for f in self._failed[key] if key[0] != set_id]
            for f in rounds:
                f.owed -= gone
            rounds = [f for f in rounds if f.owed]
            if rounds:
                self._failed[key] = rounds
            else:
                del self._failed[key]

    def _add_request(self, key: PendingKey, rank: int, req: pb.Request,
                     members: Tuple[int, ...]) -> None:
        p = self._pending.get(key)
        if p is None:
            p = Pending(req.name, req.op, req.process_set_id, members, self._clock())
            self._pending[key] = p
        if rank in p.requests:
            return self._duplicate(rank, req)
        p.requests[rank] = req
        p.arrived[rank] = self._clock()
        gone = sorted(set(p.members) & self._departed)
        if gone:
            self._fail_departed(key, gone[0])
        else:
            self._try_complete(key)

    def _duplicate(self, rank: int, req: pb.Request) -> None:
        return self._rank_error(
            rank, req, pb.INVALID,
            f"{op_name(req.op)} '{req.name}': rank {rank} submitted this name again while it "
            f"was in flight; names must be unique among a rank's pending requests")

    def _joined_in(self, set_id: int) -> Set[int]:
        """Members of process set ``set_id`` that count as joined: they joined it, or
        joined globally (process set 0, which every rank belongs to)."""
        return set(self._joined.get(set_id, ())) | set(self._joined.get(0, ()))

    def _required(self, p: Pending) -> Set[int]:
        if p.op in _ALL_MEMBERS_OPS or not self._joined:
            return set(p.members)
        return set(p.members) - self._joined_in(p.process_set_id)

    def _try_complete(self, key: PendingKey) -> None:
        p = self._pending[key]
        if not self._required(p) <= set(p.requests):
            return
        del self._pending[key]
        if p.op == pb.ADD_PROCESS_SET:
            return self._complete_add(p)
        joined = [r for r in p.members if r not in p.requests]
        result = validate(p.name, p.process_set_id, p.members, p.requests, joined)
        if isinstance(result, pb.Error):
            return self._group_error(p, result)
        if p.op == pb.REMOVE_PROCESS_SET:
            self._remove_set(p.process_set_id)
        now = self._clock()
        for t in result.tensors:  # how long each member waited for the others
            t.ready_us.extend(int((now - p.arrived[r]) * 1e6) if r in p.arrived else -1
                              for r in p.members)
        if not joined and not self._joined.get(0) and (self.tuner is None or self.tuner.done):
            self._assign_cache_slot(result, p.requests)
        self._ready.append(ReadyItem(result, self._told(p) if p.watchers else p.members))

    def _assign_cache_slot(self, resp: pb.Response, requests: Dict[int, pb.Request]) -> None:
        """Give a global-set call a response-cache slot, once per (name, every rank's
        request signature), while slots last; a small host one also gets an inline offset
        (see TensorEntry.cache_slot and cache_inline_offset)."""
        if (resp.process_set_id != 0 or resp.op not in CACHEABLE_OPS
                or len(resp.tensors) != 1):
            return
        req = requests[min(requests)]
        key = (req.name, tuple(cache_signature(requests[r]) for r in sorted(requests)))
        found = self._cache_slots.get(key)
        if found is None:
            if len(self._cache_slots) >= self.cache_capacity:
                return
            offset = None
            # device tensors never travel inline (the cycle segment is host memory); the
            # place holds every rank's input (an allgather's rows may differ per rank)
            nbytes = (0 if req.memory else
                      max(inline_bytes(requests[r]) for r in requests))
            room = -(-nbytes // INLINE_ALIGN) * INLINE_ALIGN
            if 0 < nbytes <= INLINE_MAX_BYTES and self._inline_used + room <= INLINE_AREA_BYTES:
                offset, self._inline_used = self._inline_used, self._inline_used + room
            found = self._cache_slots[key] = (len(self._cache_slots) + 1, offset)
        resp.tensors[0].cache_slot = found[0]
        if found[1] is not None:
            resp.tensors[0].cache_inline_offset = found[1]

    # -- join --------------------------------------------------------------------------
    def _join(self, rank: int, req: pb.Request, members: Tuple[int, ...]) -> None:
        """``rank``, a member, joined process set ``req.process_set_id`` (0: globally,
        which counts in every set): from now until the set's join completes, the set's
        collectives complete without it (see validation.validate for what it
        contributes)."""
        ps_id = req.process_set_id
        gone = sorted(set(members) & self._departed)
        if gone:  # it left without joining: this join can never complete
            return self._fail_join(ps_id, {rank: req.name}, gone[0])
        joined = self._joined.setdefault(ps_id, {})
        if rank in joined:
            where = f" process set {ps_id}" if ps_id else ""
            return self._rank_error(rank, req, pb.INVALID,
                                    f"join '{req.name}': rank {rank} has already joined{where}")
        if ps_id == 0 and not joined and self._cache_slots:
            # cached calls are global-set calls agreed without the leader, by every rank:
            # a joined rank would not take part, so every rank drops them
            flush = pb.CoordinatorMessage(cache_flush=pb.CacheFlush(reason=f"rank {rank} joined"))
            self._extra.extend((r, flush) for r in range(self.size)
                               if r not in self._departed and r not in self._lost)
        joined[rank] = req.name
        for key, p in list(self._pending.items()):
            if (key in self._pending and rank in p.members and p.op not in _ALL_MEMBERS_OPS
                    and (ps_id == 0 or p.process_set_id == ps_id)):
                self._try_complete(key)
        # a global join may complete the join of any set (set 0's last)
        for set_id in sorted(self._joined, key=lambda i: i == 0) if ps_id == 0 else [ps_id]:
            self._check_join_done(set_id, rank)

    def _check_join_done(self, set_id: int, last: int) -> None:
        """Complete the join of process set ``set_id`` once every member still present
        counts as joined; ``last`` is the rank whose join completed it. Only the ranks
        that joined this set get the response (its result is ``last``); the epoch ends."""
        joined = self._joined.get(set_id)
        if not joined:
            return
        members = self._sets[set_id]
        active = set(members) - self._departed - self._lost
        if not active <= self._joined_in(set_id):
            return
        resp = pb.Response(op=pb.JOIN, process_set_id=set_id,
                           tensors=[pb.TensorEntry(name=joined.get(last, "join"))],
                           member_ranks=members, last_joined_rank=last,
                           prescale_factor=1.0, postscale_factor=1.0)
        recipients = tuple(range(self.size)) if set_id == 0 else tuple(sorted(joined))
        del self._joined[set_id]
        self._ready.append(ReadyItem(resp, recipients))

    # -- errors ------------------------------------------------------------------------
    def _told(self, p: Pending) -> Tuple[int, ...]:
        """Who gets ``p``'s outcome: its members and its watchers still present."""
        return tuple(sorted(r for r in {*p.members, *p.watchers}
                            if r not in self._departed and r not in self._lost))

    def _error_response(self, req: pb.Request, err: pb.Error) -> pb.Response:
        members = self._sets.get(req.process_set_id, ())
        return pb.Response(op=req.op, process_set_id=req.process_set_id,
                           tensors=[pb.TensorEntry(name=req.name)], error=err,
                           member_ranks=members, last_joined_rank=-1)

    def _rank_error(self, rank: int, req: pb.Request, kind: int, message: str) -> None:
        err = make_error(kind, message, op=op_name(req.op), name=req.name, rank_a=rank)
        self._note_failure(rank, req, err)
        self._ready.append(ReadyItem(self._error_response(req, err), (rank,)))

    def _group_error(self, p: Pending, err: pb.Error) -> None:
        resp = pb.Response(op=p.op, process_set_id=p.process_set_id,
                           tensors=[pb.TensorEntry(name=p.name)], error=err,
                           member_ranks=self._sets.get(p.process_set_id, p.members),
                           last_joined_rank=-1)
        recipients = tuple(sorted(r for r in p.requests if r not in self._departed))
        for r in recipients:
            self._note_failure(r, p.requests[r], err)
        recipients += tuple(sorted(r for r in p.watchers if r not in self._departed))
        self._ready.append(ReadyItem(resp, recipients))

    def _fail_departed(self, key: PendingKey, gone: int) -> None:
        p = self._pending.pop(key)
        peer = self.peer(gone)
        opn = op_name(p.op)
        reason = self._goodbye_reasons.get(gone, "")
        self._group_error(p, pb.Error(
            kind=pb.PEER_LOST, op=opn, name=p.name, rank_a=-1, rank_b=-1,
            message=f"{opn} '{p.name}': rank {gone} (host {peer.host}, pid {peer.pid}) has "
                    f"shut down" + (f": {reason}" if reason else ""), origin_rank=gone,
            origin_host=peer.host, origin_pid=peer.pid,
            cause=reason or "it called ddl.shutdown()"))

    def _fail_joins(self, gone: int) -> None:
        """Fail the join in progress of every set of ``gone`` (it left without joining,
        so the join cannot complete), as a name waiting on it."""
        for set_id, joined in list(self._joined.items()):
            if joined and gone in self._sets.get(set_id, ()):
                del self._joined[set_id]
                self._fail_join(set_id, joined, gone)

    def _fail_join(self, set_id: int, joiners: Dict[int, str], gone: int) -> None:
        """The join of ``joiners`` (rank -> its request's name) in process set ``set_id``
        fails with PEER_LOST: ``gone``, a member, left without joining."""
        key = (set_id, next(iter(joiners.values())))
        self._pending[key] = Pending(key[1], pb.JOIN, set_id, self._sets.get(set_id, ()),
                                     self._clock(),
                                     requests={r: pb.Request() for r in joiners})
        self._fail_departed(key, gone)

    # -- leaving -----------------------------------------------------------------------
    def goodbye(self, rank: int, reason: str = "") -> List[Delivery]:
        """``rank`` left cleanly (``reason``: what it said); names that need it fail with
        PEER_LOST."""
        self._departed.add(rank)
        if reason and reason != "shutdown":
            self._goodbye_reasons[rank] = reason[:500]
        # Ranks waiting for it in a cached call (unseen here) learn who left and why.
        peer = self.peer(rank)
        why = self._goodbye_reasons.get(rank, "it called ddl.shutdown()")
        notice = pb.CoordinatorMessage(warning=pb.Error(
            kind=pb.PEER_LOST, rank_a=-1, rank_b=-1, origin_rank=rank, origin_host=peer.host,
            origin_pid=peer.pid, cause=why,
            message=f"rank {rank} (host {peer.host}, pid {peer.pid}) has shut down: {why}"))
        self._extra.extend((r, notice) for r in range(self.size)
                           if r not in self._departed and r not in self._lost)
        for joined in self._joined.values():
            joined.pop(rank, None)
        self._fail_joins(rank)  # and a later join of its sets fails at once (see _join)
        self._bad_adds.pop(rank, None)
        self._spent_bad_adds.pop(rank, None)
        self._forget_owed({rank})
        for key, p in list(self._pending.items()):
            p.watchers.pop(rank, None)
            if rank in p.members:
                self._fail_departed(key, rank)
            elif not p.requests and not p.watchers:   # nobody waits on it any more
                del self._pending[key]
        return self._flush()

    def lost(self, rank: int, cause: str, err: Optional[pb.Error] = None) -> List[Delivery]:
        """``rank``'s stream closed without a goodbye: abort every other rank, with
        ``err`` if given (e.g. COORDINATOR_LOST when its node's coordinator went away),
        else a PEER_LOST naming ``rank``."""
        self._lost.add(rank)
        if self.fatal is not None:
            return []
        if err is None:
            peer = self.peer(rank)
            err = peer_lost_error(rank, peer.host, peer.pid, cause)
            self._describe_in_flight(rank, err)
        return self.abort(err)

    def _describe_in_flight(self, rank: int, err: pb.Error) -> None:
        """Name in ``err`` what was in flight for ``rank``: a name the others were waiting
        for it to submit, else the last response it was sent (it may have died in it)."""
        waiting = [p for p in self._pending.values()
                   if rank in p.members and rank not in p.requests and p.requests]
        if waiting:
            p = min(waiting, key=lambda q: q.since)
            err.op, err.name = op_name(p.op), p.name
            err.message += (f"; in flight: {err.op} '{p.name}', submitted by ranks "
                            f"{sorted(p.requests)}")
            return
        last = self._last_response.get(rank)
        if last is not None:
            err.op, err.seq = op_name(last.op), last.seq
            err.name = last.tensors[0].name if last.tensors else ""
            # (cached calls run since then without the leader: this may be long past)
            err.message += (f"; the last call the coordinator ordered for it: {err.op} "
                            f"'{err.name}' (seq {last.seq})")

    def abort(self, err: pb.Error) -> List[Delivery]:
        """Make the job fatal with ``err``; an Abort to every rank still present."""
        if self.fatal is None:
            self.fatal = err
        gone = self._departed | self._lost
        return [(r, pb.CoordinatorMessage(abort=self.fatal))
                for r in range(self.size) if r not in gone]

    # -- stalls ------------------------------------------------------------------------
    def inspect_stalls(self) -> List[Delivery]:
        """Warn about names older than the check time; abort past the shutdown time."""
        if self.fatal is not None:
            return []
        now = self._clock()
        out: List[Delivery] = []
        waits: Optional[Dict[int, Tuple[Pending, int]]] = None  # made once, when needed
        for p in sorted(self._pending.values(), key=lambda q: q.since):
            age = now - p.since
            shutdown = 0 < self.stall_shutdown_time <= age
            if not shutdown and (p.warned or not 0 < self.stall_check_time <= age):
                continue
            submitted = sorted(p.requests)
            missing = sorted(self._required(p) - set(p.requests))
            if waits is None:
                waits = self._waits()
            watching = f", watched by ranks {sorted(p.watchers)}" if p.watchers else ""
            body = (f"{p.describe()} has waited {age:.1f} s: submitted by ranks {submitted}"
                    f"{watching}, missing ranks {missing}{_elsewhere(missing, waits)}")
            if shutdown:
                log.error("StallError: %s", body)
                err = make_error(pb.STALL, body, op=op_name(p.op), name=p.name)
                err.origin_rank = missing[0] if missing else -1  # the rank to blame
                return self.abort(err)
            p.warned = True
            log.warning("stall: %s", body)
            warning = make_error(pb.STALL, f"stall: {body}", op=op_name(p.op), name=p.name)
            out.extend((r, pb.CoordinatorMessage(warning=warning)) for r in self._told(p))
        return out

    def _waits(self) -> Dict[int, Tuple[Pending, int]]:
        """Per rank: its oldest name at the leader, and how many it has there."""
        out: Dict[int, Tuple[Pending, int]] = {}
        for q in self._pending.values():
            for rank in [*q.requests, *q.watchers]:
                found = out.get(rank)
                if found is None:
                    out[rank] = (q, 1)
                else:
                    out[rank] = (q if q.since < found[0].since else found[0], found[1] + 1)
        return out

    # -- order -------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _flush(self) -> List[Delivery]:
        self._withdraw_failed_calls()
        extra, self._extra = self._extra, []
        setting = self.tuner.setting() if self.tuner is not None else None
        threshold = (self.fusion_threshold if setting is None
                     else int(setting.fusion_threshold_bytes))
        items = flush(self._ready, threshold, self._next_seq)
        per_rank: Dict[int, List[pb.Response]] = {}
        for item in items:
            if setting is not None:
                item.response.tuning.CopyFrom(setting)
            if item.response.HasField("error"):
                item.response.error.seq = item.response.seq
            for r in item.recipients:
                per_rank.setdefault(r, []).append(item.response)
                self._last_response[r] = item.response
        if self.tuner is not None and items:
            self.tuner.observe([item.response for item in items])
        return extra + [(r, pb.CoordinatorMessage(responses=pb.ResponseList(responses=resps)))
                        for r, resps in sorted(per_rank.items())]


def _elsewhere(missing: Sequence[int], waits: Dict[int, Tuple[Pending, int]],
               most: int = 3) -> str:
    """What the first ``most`` missing ranks wait on instead, among the names at the
    leader (``waits``: :meth:`Leader._waits`): a call another rank has not made (a name,
    group or order that differs between ranks), e.g. ``; rank 1 waits on allreduce 'y'
    in process set 0``."""
    parts = []
    for rank in missing[:most]:
        if rank in waits:
            oldest, count = waits[rank]
            more = f" (and {count - 1} more)" if count > 1 else ""
            parts.append(f"rank {rank} waits on {oldest.describe()}{more}")
    return "".join(f"; {part}" for part in parts)
