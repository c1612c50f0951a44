"""Steady-state negotiation without the leader: the response cache and its cycles.

A training loop submits the same names with the same arguments every step. The leader
gives such a call (a global-set allreduce or broadcast) a *cache slot* the first time
(``TensorEntry.cache_slot``); every rank stores the agreed response under that slot when
it executes it, in the one global order, so all ranks' caches agree. Later calls that
match their slot skip gRPC: they are agreed on in *cycles* over the data plane.

A cycle is one tiny allreduce (Min over int8, one entry per slot) among all ranks, on a
shared-memory group of its own (so it never interleaves with the leader-ordered
collectives of the engine thread), run by one background thread per rank:

* each rank votes 1 for a slot it has a call waiting on, -1 to drop a slot (its call came
  with other arguments, or the leader asked for a flush because a rank joined), else 0;
* a slot whose minimum is 1 is ready everywhere: every rank runs it now, in slot order,
  fusing allreduces as the leader would;
* a slot whose minimum is -1 is dropped by every rank at once; a call that was waiting
  on it goes to the leader instead, which then reports any mismatch as usual.

A rank enters a cycle only when it has a vote to cast, and a cycle completes once every
rank has entered one; a rank with nothing waiting is not needed until it submits. Cycles
that make no progress back off (up to 10 ms) until new work arrives. Waiting is bounded:
the shared-memory wait checks the job's fatal error every 50 ms, and a call waiting longer
than ``DDL_STALL_SHUTDOWN_TIME_SECONDS`` raises StallError on this rank.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from ddl._cache_signature import CACHEABLE_OPS, cache_signature
from ddl._dtypes import ReduceOp
from ddl._errors import StallError
from ddl._timeline import QUEUE, timeline
from ddl.v1 import coordinator_pb2 as pb

log = logging.getLogger("ddl")

_BACKOFF_START_S = 1e-4
_BACKOFF_MAX_S = 0.01


def response_signature(resp: pb.Response, tensor: pb.TensorEntry) -> tuple:
    """The signature (see :func:`cache_signature`) of a request matching ``tensor``."""
    return (resp.op, resp.dtype, tuple(tensor.shape), resp.reduce_op,
            float(resp.prescale_factor), float(resp.postscale_factor),
            resp.root_rank if resp.op == pb.BROADCAST else 0, resp.process_set_id)


class ResponseCache:
    """This rank's cache slots: slot -> (name, signature, one-tensor response)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._slots: Dict[int, Tuple[str, tuple, pb.Response]] = {}
        self._by_name: Dict[str, int] = {}
        self._dropped: Set[int] = set()

    def insert(self, response: pb.Response) -> None:
        """Store the slotted tensors of ``response`` (call before its handles complete,
        so that a resubmission sees the slot)."""
        for t in response.tensors:
            slot = t.cache_slot
            if not slot or slot > self.capacity:
                continue
            with self._lock:
                if slot in self._dropped or slot in self._slots:
                    continue
                template = pb.Response()
                template.CopyFrom(response)
                del template.tensors[:]
                template.tensors.add().CopyFrom(t)
                template.seq = 0
                self._slots[slot] = (t.name, response_signature(response, t), template)
                self._by_name[t.name] = slot

    def lookup(self, req: pb.Request) -> Tuple[int, int]:
        """``(slot, 0)`` if ``req`` matches a live slot; ``(0, stale)`` if its name has a
        live slot with other arguments (vote to drop ``stale``); ``(0, 0)`` otherwise."""
        if req.op not in CACHEABLE_OPS or req.process_set_id != 0:
            return 0, 0
        with self._lock:
            slot = self._by_name.get(req.name)
            if slot is None or slot in self._dropped:
                return 0, 0
            if self._slots[slot][1] == cache_signature(req):
                return slot, 0
            return 0, slot

    def drop(self, slots) -> None:
        with self._lock:
            for s in slots:
                self._dropped.add(int(s))
                found = self._slots.pop(int(s), None)
                if found is not None and self._by_name.get(found[0]) == int(s):
                    del self._by_name[found[0]]

    def live_slots(self) -> List[int]:
        with self._lock:
            return sorted(self._slots)

    def template(self, slot: int) -> pb.Response:
        with self._lock:
            return self._slots[slot][2]


class CycleRunner:
    """The cycle thread of one rank (see the module doc).

    ``group`` is the ranks' shared-memory group for cycles and cached collectives;
    ``run(response, entries)`` executes a response on it (False: the job failed);
    ``take(response)`` removes its entries from the engine's pending table;
    ``resend(entry)`` sends a call to the leader instead; ``on_error(exc)`` gets what
    ended the cycles (the job's fatal error, a stall, a timeout).
    """

    def __init__(self, rank: int, cache: ResponseCache, group, allreduce: Callable,
                 run: Callable, take: Callable, resend: Callable, on_error: Callable,
                 fusion_threshold: int, timeout: float, stall_check_time: float,
                 stall_shutdown_time: float):
        self.rank = rank
        self.cache = cache
        self._group = group
        self._allreduce = allreduce
        self._run_response = run
        self._take = take
        self._resend = resend
        self._on_error = on_error
        self._fusion_threshold = fusion_threshold
        self._timeout = timeout
        self._stall_check = stall_check_time
        self._stall_shutdown = stall_shutdown_time
        self._cond = threading.Condition()
        self._waiting: Dict[int, Tuple[object, float]] = {}  # slot -> (entry, since)
        self._drop: Set[int] = set()
        self._drop_all = False
        self._stopping = False
        self._warned: Set[int] = set()
        self._vote = np.zeros(cache.capacity + 1, dtype=np.int8)
        self._thread = threading.Thread(target=self._loop, name="ddl-cache-cycles",
                                        daemon=True)
        self._thread.start()

    # -- from the engine ------------------------------------------------------------------
    def add(self, slot: int, entry) -> None:
        with self._cond:
            self._waiting[slot] = (entry, time.monotonic())
            self._cond.notify()

    def drop(self, slot: int) -> None:
        with self._cond:
            self._drop.add(slot)
            self._cond.notify()

    def flush(self) -> None:
        """Vote to drop every slot (a rank joined)."""
        with self._cond:
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
            waiting = [(s, since) for s, (_, since) in self._waiting.items()]
        for slot, since in waiting:
            age = now - since
            name = self.cache_name(slot)
            if 0 < self._stall_shutdown <= age:
                raise StallError(f"StallError: allreduce '{name}' (cached) has waited "
                                 f"{age:.1f} s on rank {self.rank} for the other ranks",
                                 name=name, cause="stall")
            if 0 < self._stall_check <= age and slot not in self._warned:
                self._warned.add(slot)
                log.warning("ddl rank %d: stall: cached call '%s' has waited %.1f s for the "
                            "other ranks", self.rank, name, age)

    def cache_name(self, slot: int) -> str:
        try:
            return self.cache.template(slot).tensors[0].name
        except KeyError:
            return f"slot {slot}"

    # -- the thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not (self._waiting or self._drop or self._drop_all or self._stopping):
                    self._cond.wait()
                if backoff:
                    self._cond.wait(backoff)
                if self._stopping:
                    return
                vote = self._vote
                vote.fill(0)
                for slot in self._waiting:
                    vote[slot] = 1
                for slot in self._drop:
                    vote[slot] = -1
                if self._drop_all:
                    vote[1:] = -1
                self._drop.clear()
                self._drop_all = False
            try:
                self._allreduce(vote, ReduceOp.Min, self._group,
                                time.monotonic() + self._timeout)
            except BaseException as exc:  # fatal for the job: the engine reports it
                if not self._stopping:
                    self._on_error(exc)
                return
            backoff = 0.0 if self._apply(vote) else min(_BACKOFF_MAX_S,
                                                          max(_BACKOFF_START_S, backoff * 2))

    def _apply(self, vote: np.ndarray) -> bool:
        """Act on a cycle's outcome; True if anything ran or was dropped."""
        dropped = np.flatnonzero(vote < 0)
        ready = [int(s) for s in np.flatnonzero(vote > 0)]
        if len(dropped):
            self.cache.drop(dropped)
            with self._cond:
                moved = [self._waiting.pop(int(s))[0] for s in dropped
                         if int(s) in self._waiting]
            for entry in moved:
                self._resend(entry)
        if not ready:
            return bool(len(dropped))
        with self._cond:
            for s in ready:
                self._waiting.pop(s, None)
        if timeline.active and timeline.mark_cycles:
            timeline.mark_cycle()
        for response in self._responses(ready):
            if timeline.active:
                timeline.begin([t.name for t in response.tensors], QUEUE, {"cached": True})
            entries = self._take(response)
            if not self._run_response(response, entries):
                return True
        return True

    def _responses(self, slots: List[int]) -> List[pb.Response]:
        """The ready slots as responses, allreduces fused as the leader fuses them."""
        out: List[pb.Response] = []
        open_fused: Dict[tuple, Tuple[pb.Response, int]] = {}
        for slot in slots:
            template = self.cache.template(slot)
            if template.op != pb.ALLREDUCE:
                out.append(template)
                continue
            t = template.tensors[0]
            nbytes = int(np.prod(t.shape, dtype=np.int64)) * 8
            key = (template.dtype, template.reduce_op, template.prescale_factor,
                   template.postscale_factor)
            current = open_fused.get(key)
            if current is not None and current[1] + nbytes <= self._fusion_threshold:
                current[0].tensors.add().CopyFrom(t)
                open_fused[key] = (current[0], current[1] + nbytes)
                continue
            fused = pb.Response()
            fused.CopyFrom(template)
            out.append(fused)
            open_fused[key] = (fused, nbytes)
        return out
