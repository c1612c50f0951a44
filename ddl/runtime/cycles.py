"""Cycles: how the ranks agree on cached calls without the leader, and run the small ones.

A *cycle* is one round of votes among all ranks of the job, on a channel of its own (so
it never interleaves with the leader-ordered collectives of the engine thread). Each
rank votes one int8 per cache slot: 1 for a slot it has a call waiting on, -1 to drop a
slot (its call came with other arguments, or the leader asked for a flush because a rank
joined), else 0. The outcome for a slot is the minimum of the votes:

* a slot at 1 is ready everywhere: every rank runs it now, in slot order;
* a slot at -1 is dropped by every rank at once; a call that was waiting on it goes to
  the leader instead, which then reports any mismatch as usual.

The channel is the first backend of :data:`ddl.dataplane.backends.ORDER` that carries
the cycles (:meth:`~ddl.dataplane.backends.base.Backend.cycle_channel`), the same on every
rank; two do:

* the shared-memory backend's :class:`~ddl.dataplane.backends.shm.ShmVotes`, when every
  rank is on one host: one shared-memory round. Each rank's
  slot of the round also holds an *inline area* (``INLINE_AREA_BYTES``), where each small
  cached tensor has a fixed place given by the leader (``CachedCall.inline``): a rank
  writes the input of every inline call it votes for (packed as its reduction plan says,
  :mod:`ddl.core.reduction`; a broadcast's root only), and a ready inline call completes
  from the round itself: every rank reduces the inline bytes of all ranks in rank order
  (results are bitwise equal everywhere; Adasum combines them, :mod:`ddl.core.adasum`),
  or copies the root's, or takes its part (:func:`inline_result`: a reducescatter's
  block reduced in its collective's order, its own bytes first). One round per step,
  nothing else. A call with no inline place may still ride in the round, in each slot's
  *lone place*, when it is the only such call a rank votes for and it fits
  (:meth:`ShmVotes.lone_fits <ddl.dataplane.backends.shm.ShmVotes.lone_fits>`: any
  cacheable call, each rank's whole input, up to the lone place's size, 510.9 KiB at the
  default cache capacity): when every rank put the same call there and it is ready, it
  completes from the round too, with no collective of its own (several such calls run fused
  in one anyway), reducing in the order of the collective it replaces, so its bits are that
  collective's. Each rank then takes its own part: the whole result, its block of a
  reducescatter, what each rank sends it in an alltoall.
* the TCP backend's :class:`~ddl.dataplane.backends.tcp.TcpVotes` otherwise (or with
  ``DDL_TRANSPORT=tcp``): the votes are reduced over TCP connections of the cycles' own.

A ready call that is not inline runs as a collective on the same channel right after,
through the same backends as the engine's (:mod:`ddl.dataplane.backends`), fused with other ready
allreduces by the leader's rule (:mod:`ddl.core.fusion`). A blocking call on the fast lane
(:meth:`CycleRunner.run_fast`) votes for its slot alone, so when it is ready everywhere
it is the only ready slot, and every rank runs it alone.

A rank enters a cycle only when it has a vote to cast, and a cycle completes once every
rank has entered one; a rank with nothing waiting is not needed until it submits. A
blocking call runs its own cycles in the calling thread (:meth:`CycleRunner.drive`):
that saves two thread hand-offs. Asynchronous calls are started by the cycle thread once
the oldest has waited ``DDL_CYCLE_TIME_MS`` (0 where the host has two CPUs per local
rank: at once), and a thread that waits for one runs the cycles itself, all waiting
calls fused, without waiting. One thread at a time runs a cycle.
Cycles that make no progress back off (up to 10 ms) until new work arrives. Waiting is bounded: the channel's wait checks the job's fatal error at
least every 200 ms, and a call waiting longer than ``DDL_STALL_SHUTDOWN_TIME_SECONDS``
raises StallError on this rank.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ddl.core import dtypes as _dtypes
from ddl.core.adasum import combine_into
from ddl.core.errors import StallError
from ddl.core.fusion import fuse
from ddl.core.reduction import quiet
from ddl.dataplane.algorithms.shm_collectives import reduce_share
from ddl.dataplane.transports import shm
from ddl.runtime.cache import CachedCall, ResponseCache
from ddl.runtime.engine import Entry
from ddl.runtime.handle import Handle
from ddl.runtime.results import RESULTS
from ddl.runtime.timeline import QUEUE, timeline
from ddl.v1 import coordinator_pb2 as pb

log = logging.getLogger("ddl")

_BACKOFF_START_S = 1e-4
_BACKOFF_MAX_S = 0.01


_DROP = 0xFF  # a vote of -1, as a byte


def _slots_at(votes: bytes, vote: int) -> List[int]:
    """The slots (from 1; slot 0 marks a flush) whose outcome byte in ``votes`` is
    ``vote`` (a few among many zeros: a byte search finds them faster than NumPy)."""
    slots, at = [], votes.find(vote, 1)
    while at >= 0:
        slots.append(at)
        at = votes.find(vote, at + 1)
    return slots


# a result completed from a round: an array, or an alltoall's (received, received splits)
Result = Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]


class CycleRunner:
    """The cycles of one rank (see the module doc).

    ``votes`` (the round of a backend's
    :class:`~ddl.dataplane.backends.base.CycleChannel`) runs a cycle's round;
    ``run(response, entries, execute=None)`` executes a response (by default as a
    collective on the cycles' channel; False: the job failed); ``take(response)`` removes its
    entries from the engine's pending table; ``resend(entry)`` sends a call to the leader
    instead; ``on_error(exc)`` gets what ended the cycles (the job's fatal error, a stall,
    a timeout); ``fusion_threshold()`` the leader's current one.
    """

    def __init__(self, rank: int, cache: ResponseCache, votes, run: Callable,
                 take: Callable, resend: Callable, on_error: Callable,
                 fusion_threshold: Callable[[], int], timeout: float, stall_check_time: float,
                 stall_shutdown_time: float, cycle_time: float = 0.0):
        self.rank = rank
        self.cache = cache
        self._votes = votes  # the channel's round (ShmVotes, TcpVotes)
        self._inline = votes.inline
        self._run_response = run
        self._take = take
        self._resend = resend
        self._on_error = on_error
        self._fusion_threshold = fusion_threshold
        self._timeout = timeout
        self._stall_check = stall_check_time
        self._stall_shutdown = stall_shutdown_time
        self._cycle_time = cycle_time  # s a call waits for a waiter before the thread starts it
        # a thread blocked elsewhere at this moment: calls waiting since then start at once
        self._nudged_at = -math.inf
        self._cond = threading.Condition()
        # slot -> (entry, since, CachedCall)
        self._waiting: Dict[int, Tuple[object, float, CachedCall]] = {}
        self._drop: Set[int] = set()
        self._drop_all = False
        self._flushes_received = 0  # leader flushes this rank got (one per join)
        self._flush_cycles = 0      # cycles that flushed (slot 0 at -1), seen by every rank
        self._stopping = False
        self._dead = False  # a cycle failed: the job is over
        self._driving = threading.Lock()  # held by the thread running a cycle
        self._warned: Set[int] = set()
        self._fast: Optional[Tuple[int, float]] = None  # (slot, since) of run_fast's call
        self._vote = np.zeros(cache.capacity + 1, dtype=np.int8)
        self.lone_hits = 0  # calls completed from the lone place (tests and benchmarks)
        self._thread = threading.Thread(target=self._loop, name="ddl-cache-cycles",
                                        daemon=True)
        self._thread.start()

    # -- from the engine ------------------------------------------------------------------
    def add(self, calls: List[Tuple[CachedCall, object]], notify: bool = True) -> None:
        """Wait for ``calls`` ((cached call, entry) pairs) in cycles: the cycle thread
        starts them (``notify``), or the caller does, in :meth:`drive`."""
        now = time.monotonic()
        with self._cond:
            # with a cycle time, the thread only needs waking for the first waiting call:
            # it then waits for the oldest one, which later calls do not change (waking
            # it for each would take the GIL and a CPU from the caller: a gradient hook)
            wake = notify and not (self._cycle_time and self._waiting)
            for call, entry in calls:
                self._waiting[call.slot] = (entry, now, call)
            if wake:
                self._cond.notify()

    def drive(self, calls: List[Tuple[CachedCall, object]],
              done: Callable[[], bool] = lambda: False) -> None:
        """Run cycles in the calling thread until none of ``calls`` waits on its slot
        (each ran, moved to the leader, or failed with the job), or ``done()`` (what the
        caller waits for ended otherwise: a group that failed at another part)."""
        backoff = 0.0
        try:
            while not self._dead and not done():
                with self._cond:
                    if not any(self._waiting.get(c.slot, (None,))[0] is e for c, e in calls):
                        return
                    if backoff:
                        self._cond.wait(backoff)
                if not self._driving.acquire(timeout=_BACKOFF_MAX_S):
                    continue
                try:
                    progress = self._cycle()
                finally:
                    self._driving.release()
                if progress is None:
                    return
                backoff = 0.0 if progress else min(_BACKOFF_MAX_S,
                                                   max(_BACKOFF_START_S, backoff * 2))
        finally:
            with self._cond:
                if self._waiting and not self._dead:
                    self._cond.notify()  # others' calls: over to the cycle thread

    def nudge(self) -> None:
        """A thread is about to block on something other than these cycles (a call the
        leader answers): the cycle thread starts what waits now, without the cycle
        time, since that thread will not run it (peers may wait for it first)."""
        if self._waiting:
            with self._cond:
                if self._waiting:
                    # a moment, not a flag: a nudge that a waiter's cycle answered first
                    # leaves the next calls their cycle time
                    self._nudged_at = time.monotonic()
                    self._cond.notify()

    def drop(self, slot: int) -> None:
        with self._cond:
            self._drop.add(slot)
            self._cond.notify()

    def flush(self) -> None:
        """Vote to drop every slot (a rank joined), unless a cycle already did.

        Every rank gets the leader's flush once per join, but they may see it at
        different moments: the first rank to vote it (slot 0 at -1) drops every slot on
        every rank in that cycle, and a rank whose own flush arrives after that cycle must
        not ask for another one, which the others, with nothing to vote, would never
        join. So each rank counts the flushes it received and the flush cycles it saw."""
        with self._cond:
            self._flushes_received += 1
            if self._flushes_received > self._flush_cycles:
                self._drop_all = True
                self._cond.notify()

    def stop(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def check_stall(self) -> None:
        """Raise StallError when a cached call has waited past the shutdown time (called
        from the shared-memory wait, at least every 50 ms)."""
        if self._stopping:
            raise StallError(f"rank {self.rank}: shutting down", cause="shutdown")
        now = time.monotonic()
        with self._cond:
            waiting = [(s, w[1]) for s, w in self._waiting.items()]
        fast = self._fast
        if fast is not None:
            waiting.append(fast)
        for slot, since in waiting:
            age = now - since
            name = self.cache_name(slot)
            if 0 < self._stall_shutdown <= age:
                raise StallError(f"allreduce '{name}' (cached) has waited "
                                 f"{age:.1f} s on rank {self.rank} for the other ranks",
                                 name=name, cause="stall")
            if 0 < self._stall_check <= age and slot not in self._warned:
                self._warned.add(slot)
                log.warning("ddl rank %d: stall: cached call '%s' has waited %.1f s for the "
                            "other ranks", self.rank, name, age)

    def cache_name(self, slot: int) -> str:
        try:
            return self.cache.call(slot).name
        except KeyError:
            return f"slot {slot}"

    # -- running cycles -------------------------------------------------------------------
    def _loop(self) -> None:
        shm.run_in_background()
        backoff = 0.0
        while True:
            with self._cond:
                while not (self._waiting or self._drop or self._drop_all or self._stopping):
                    self._cond.wait()
                if backoff:
                    self._cond.wait(backoff)
                self._give_waiters_time()
                if self._stopping or self._dead:
                    return
            with self._driving:
                # a waiter may have run a cycle meanwhile, and the next batch begun to
                # arrive: it gets its cycle time (started now, it would be split)
                with self._cond:
                    if self._due_in() > 0:
                        continue
                progress = self._cycle()
            if progress is None:
                return
            backoff = 0.0 if progress else min(_BACKOFF_MAX_S,
                                               max(_BACKOFF_START_S, backoff * 2))

    def _due_in(self) -> float:
        """Seconds before the cycle thread starts a cycle (hold ``_cond``): 0 once the
        oldest waiting call has waited the cycle time, was waiting at a nudge, or at
        once for drops, stops, or nothing waiting."""
        if not (self._cycle_time and self._waiting) or (self._drop or self._drop_all
                                                        or self._stopping):
            return 0.0
        oldest = min(since for _, since, _ in self._waiting.values())
        if oldest <= self._nudged_at:
            return 0.0
        return max(0.0, oldest + self._cycle_time - time.monotonic())

    def _give_waiters_time(self) -> None:
        """Hold the cycle thread back (with ``_cond`` held) until the oldest waiting call
        has waited the cycle time, unless a thread that waits runs the calls first:
        calls submitted meanwhile are fused into that thread's cycle. Drops, stops and
        nudges go at once."""
        left = self._due_in()
        while left > 0:
            self._cond.wait(left)
            left = self._due_in()

    def _cycle(self) -> Optional[bool]:
        """One cycle, if this rank has a vote to cast (hold ``_driving``). True if anything
        ran or was dropped, False if nothing did, None once cycles are over."""
        with self._cond:
            if self._stopping or self._dead:
                return None
            if not (self._waiting or self._drop or self._drop_all):
                return True  # another thread's cycle took care of everything
            vote = self._vote
            vote.fill(0)
            inline: List[Tuple[np.ndarray, CachedCall]] = []
            others: List[Tuple[np.ndarray, CachedCall]] = []  # no inline place
            for slot, (entry, _, call) in self._waiting.items():
                vote[slot] = 1
                if self._inline and not call.request.memory:   # (device arrays: never)
                    (inline if call.inline >= 0 else others).append((entry.array, call))
            for slot in self._drop:
                vote[slot] = -1
            if self._drop_all:
                vote[:] = -1  # slot 0 marks a flush cycle
            self._drop.clear()
            self._drop_all = False
        try:
            # one such call may ride in the lone place; several run fused anyway
            lone = (others[0] if len(others) == 1 and self._votes.lone_fits(others[0][1])
                    else None)
            slots = self._votes.exchange(vote, inline, time.monotonic() + self._timeout, lone)
        except BaseException as exc:  # fatal for the job: the engine reports it
            self._dead = True
            self._votes.abandon()
            if not self._stopping:
                self._on_error(exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt in a driving caller
            return None
        progress = self._apply(self._votes.outcome, slots)
        if not progress:
            # cycles that keep running without progress (ranks waiting on different
            # slots) never sleep in the shared-memory wait, which is where stalls are
            # checked: check here too, so such a call still ends in a StallError
            try:
                self.check_stall()
            except StallError as exc:
                self._dead = True
                self._votes.abandon()
                if not self._stopping:
                    self._on_error(exc)
                return None
        return progress

    def _apply(self, outcome: np.ndarray, slots) -> bool:
        """Act on a cycle's outcome (the minimum vote per slot); True if anything ran or
        was dropped. ``slots``: every rank's inline bytes and lone place (shared memory
        only)."""
        votes = outcome.tobytes()
        dropped = self._apply_drops(votes)
        ready = _slots_at(votes, 1)
        if not ready:
            return dropped
        with self._cond:
            calls = [self._waiting.pop(s)[2] for s in ready]
        if timeline.active and timeline.mark_cycles:
            timeline.mark_cycle()
        # inline calls first: their bytes are in this round's slots, which the group's
        # next round (a larger call's collective) reuses
        rest = []
        lone = -1  # the lone place's slot, read once needed
        for call in calls:
            at = call.inline if self._inline else -1
            if at < 0 and self._inline:
                if lone < 0:
                    lone = self._votes.lone
                if call.slot == lone:
                    at = self._votes.lone_at
            if at < 0:
                rest.append(call)
            elif not self._run_inline(call, slots, at):
                self._votes.abandon()
                return True
        for response in self._responses(rest) if rest else ():
            if timeline.active:
                timeline.begin([t.name for t in response.tensors], QUEUE, {"cached": True})
            entries = self._take(response)
            if not self._run_response(response, entries):
                self._votes.abandon()
                return True
        return True

    def _apply_drops(self, votes: bytes) -> bool:
        """Act on the drops (and a flush) of a cycle's outcome; True if any."""
        if votes[0] == _DROP:  # a flush cycle: it answers every flush received so far
            with self._cond:
                self._flush_cycles += 1
                if self._flush_cycles >= self._flushes_received:
                    self._drop_all = False
        dropped = _slots_at(votes, _DROP)
        if dropped:
            self.cache.drop(dropped)
            with self._cond:
                moved = [self._waiting.pop(s)[0] for s in dropped if s in self._waiting]
            for entry in moved:
                self._resend(entry)
        return bool(dropped)

    def _run_inline(self, call: CachedCall, slots: Tuple[np.ndarray, ...], at: int) -> bool:
        """Complete a call from the cycle's round, its bytes at ``at`` in each slot (its
        inline place, or the lone place); False once the job failed."""
        entries = self._take(call.template)
        if at != call.inline:
            self.lone_hits += 1
        if timeline.active:
            timeline.begin([call.name], QUEUE, {"cached": True})
            timeline.begin([call.name], _dtypes.op_name(call.op).upper(),
                           {"transport": "shm", "bytes": call.nbytes, "algorithm":
                            "cycle_inline" if at == call.inline else "cycle_lone"})

        def execute(response, entries) -> None:
            entry = entries.get(call.name)
            out = inline_result(call, slots, self.rank,
                                entry.array if entry is not None else None, at,
                                self._votes.lone_shares(call) if at != call.inline else ())
            if timeline.active:
                timeline.end(call.name)
            if entry is not None:
                entry.handle._set_result(entry.finish(out))

        return self._run_response(call.template, entries, execute)

    # -- the fast lane ---------------------------------------------------------------------
    @property
    def inline(self) -> bool:
        """Whether small calls travel inline with the votes (the shared-memory channel)."""
        return self._inline

    def run_fast(self, call: CachedCall, array: np.ndarray) -> Union[Result, Handle, None]:
        """Run the blocking cached ``call`` on ``array`` (this rank's input, as the slot
        wants it) in one cycle of its own, in the calling thread; the result, reshaped.

        None (nothing ran for this call) when it must take the usual path instead:
        another call waits in cycles or another thread runs one; or the cycle did not
        complete it (a peer was not at this call yet, or dropped its slot). The caller
        guarantees that ``call``'s name is in flight nowhere else on this rank. The
        cycle is an ordinary one, so peers on the usual path take part in it as ever.
        A call with no inline place returns the handle of its collective, run alone
        (completed: its result or its own error). Raises what ended the cycles (the
        engine then has the job's fatal error)."""
        if self._waiting or self._drop or self._drop_all or self._dead or self._stopping:
            return None
        if not self._driving.acquire(False):
            return None
        try:
            # a cycle that began before those checks may have dropped the slot since (only
            # a cycle drops, holding _driving): a call waiting in _waiting would then have
            # been moved to the leader, this one must take the usual path itself
            if not self.cache.holds(call) or self._drop_all or self._waiting:
                return None
            vote = self._vote
            vote.fill(0)
            vote[call.slot] = 1
            self._fast = (call.slot, time.monotonic())
            inline = lone = None
            # (a device array never has an inline place: the leader gives it none; over
            # TCP the votes carry no bytes)
            if call.inline >= 0 and self._inline:
                inline = ((array, call),)
            try:
                if (inline is None and self._inline and not call.request.memory
                        and self._votes.lone_fits(call)):
                    lone = (array, call)
                slots = self._votes.exchange(vote, inline or (),
                                             time.monotonic() + self._timeout, lone)
            except BaseException as exc:
                self._dead = True
                self._votes.abandon()
                if not self._stopping:
                    self._on_error(exc)
                raise
            finally:
                self._fast = None
            votes = self._votes.outcome.tobytes()
            if votes.find(_DROP) >= 0:
                self._apply_drops(votes)
            if votes[call.slot] != 1:
                return None
            if inline is not None:
                return inline_result(call, slots, self.rank, array, call.inline)
            if lone is not None and self._votes.lone == call.slot:
                self.lone_hits += 1
                return inline_result(call, slots, self.rank, array, self._votes.lone_at,
                                     self._votes.lone_shares(call))
            return self._run_alone(call, array)
        finally:
            self._driving.release()

    def _run_alone(self, call: CachedCall, array: np.ndarray) -> Handle:
        """Run the ready call that is not inline as its own collective, as a cycle of the
        usual path runs it (every rank ready with only it has the same response); its
        handle, completed."""
        handle = Handle(_dtypes.op_name(call.op), call.name, self._timeout)
        if not self._run_response(call.template, {call.name: Entry(call.request, array, handle)}):
            self._votes.abandon()  # the job failed: as _apply leaves it
        return handle

    def _responses(self, calls: List[CachedCall]) -> List[pb.Response]:
        """The ready slots as responses, allreduces fused by the leader's rule
        (:func:`ddl.core.fusion.fuse`); the cached templates are not changed."""
        out: List[pb.Response] = []
        for first, *rest in fuse([c.template for c in calls], self._fusion_threshold()):
            if rest:
                fused = pb.Response()
                fused.CopyFrom(first)
                for other in rest:
                    fused.tensors.extend(other.tensors)
                first = fused
            out.append(first)
        return out


def inline_result(call: CachedCall, slots: Tuple[np.ndarray, ...], rank: int,
                  array: Optional[np.ndarray], at: int,
                  shares: Sequence[int] = ()) -> Result:
    """The result of the ready ``call`` from its round's ``slots`` (every rank's, in rank
    order, so the result is bitwise equal on every rank), its bytes at byte ``at`` of each,
    in ``call``'s shape (an allgather's: every rank's rows, each rank's at ``at`` in its
    slot; a reducescatter's and an alltoall's, this rank's part as
    :attr:`CachedCall.parts` says; an alltoall's result is ``(received,
    received_splits)``); ``array``: this rank's input (a broadcast's root copies its
    own). An allreduce
    reduces in rank order, as the ``one_round`` collective does; with ``shares``
    (wire-element boundaries, one share per rank) each share in the order of the
    ``reduce_scatter`` collective (its rank's bytes first, then the others'), so that the
    result is bitwise the one its collective gives."""
    a, b = at, at + call.nbytes
    if call.op == pb.ALLREDUCE:
        plan, fn = call.plan, call.ufunc
        acc = _result(plan.wire_count(call.count), plan.wire)
        with quiet():  # overflow to inf is the contract, not a warning
            if fn is None:  # Adasum: every rank's bytes are here, in rank order
                combine_into([s[a:b].view(plan.wire) for s in slots], [acc.size], acc)
            elif shares:
                views = [s[a:b].view(plan.wire) for s in slots]
                for i, own in enumerate(views):
                    lo, hi = shares[i], shares[i + 1]
                    reduce_share(fn, own[lo:hi],
                                 [v[lo:hi] for j, v in enumerate(views) if j != i],
                                 acc[lo:hi])
            else:
                fn(slots[0][a:b].view(plan.wire), slots[1][a:b].view(plan.wire), out=acc)
                for j in range(2, len(slots)):
                    fn(acc, slots[j][a:b].view(plan.wire), out=acc)
        out = plan.finish(acc, None if plan.in_place else _result(call.count, call.dtype))
    elif call.op == pb.ALLGATHER:   # every rank's rows, in rank order
        out = _result(math.prod(call.out_shape), call.dtype)
        raw, pos = out.view(np.uint8), 0
        for s, rows in zip(slots, call.firsts):
            size = rows * call.row_bytes
            raw[pos:pos + size] = s[a:a + size]
            pos += size
    elif call.op == pb.REDUCESCATTER:   # this rank's block, its own bytes first
        plan = call.plan
        lo, hi, shape = call.parts[rank]
        views = [s[a:b].view(plan.wire)[lo:hi] for s in slots]
        acc = _result(hi - lo, plan.wire)
        with quiet():
            reduce_share(call.ufunc, views[rank], views[:rank] + views[rank + 1:], acc)
        out = plan.finish(acc, None if plan.in_place
                          else _result(math.prod(shape), call.dtype))
        return out.reshape(shape)
    elif call.op == pb.ALLTOALL:   # what each rank sends this one, in rank order
        shape, received, pieces = call.parts[rank]
        out = _result(math.prod(shape), call.dtype)
        raw, pos = out.view(np.uint8), 0
        for j, start, size in pieces:
            raw[pos:pos + size] = slots[j][a + start:a + start + size]
            pos += size
        return out.reshape(shape), np.array(received, dtype=np.int64)
    elif rank == call.root_rank:
        out = _result(call.count, call.dtype)
        np.copyto(out, array.reshape(-1), casting="unsafe")
    else:
        out = _result(call.count, call.dtype)
        np.copyto(out, slots[call.root_rank][a:b].view(call.dtype))
    return out.reshape(call.out_shape)


def _result(count: int, dtype: np.dtype) -> np.ndarray:
    """Memory for a result completed from a round: recycled (:mod:`ddl.runtime.results`)
    from the pool's size on, where the kernel would fault fresh pages in; below, a plain
    allocation, which costs these calls less than aligning it would save JAX's copy."""
    if count * dtype.itemsize >= RESULTS.min_bytes:
        return RESULTS.empty(count, dtype)
    return np.empty(count, dtype)
