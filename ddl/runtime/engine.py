"""The background engine of one worker.

User threads call :meth:`Engine.submit`; requests leave on the control stream in batches.
The leader answers with responses in one global order; the control reader thread queues
them, and the executor thread runs them strictly in that order (so every rank moves bytes
in the same order, whatever order it submitted in).

Failure model: a response error of kind MISMATCH/INVALID fails only its tensors. Any
fatal error (peer lost, coordinator lost, stall, shutdown) is sticky: it fails every
pending handle, makes every later call raise it, and interrupts the data plane through
:meth:`check_abort`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ddl.core import dtypes as _dtypes
from ddl.core.errors import (CoordinatorLostError, DDLError, DuplicateNameError, FatalError,
                             InvalidRequestError, MismatchError, PeerLostError, ShutdownError,
                             StallError)
from ddl.runtime.handle import Handle
from ddl.runtime.timeline import NEGOTIATE, QUEUE, timeline
from ddl.v1 import coordinator_pb2 as pb

log = logging.getLogger("ddl")
# After a data-plane failure, how long to wait for the control plane's abort, which names
# the root cause, before raising the data-plane error itself.
ROOT_CAUSE_WAIT_S = 1.0
# The goodbye reason of a process that exits after its job failed because of another
# rank: its departure is a consequence, never the root cause.
SECONDARY_DEPARTURE = "the process exited after the job failed: "
# How long a call waits for a name of its own still in flight whose answer comes at once
# (see Engine._clash) before it is refused as a duplicate.
SETTLE_WAIT_S = 2.0

_FATAL_KINDS = {
    pb.PEER_LOST: PeerLostError,
    pb.COORDINATOR_LOST: CoordinatorLostError,
    pb.STALL: StallError,
    pb.SHUTDOWN: ShutdownError,
}


@dataclass
class Entry:
    """One array of one collective call on this rank, from submit to completion."""

    request: pb.Request
    array: Optional[np.ndarray]  # host input (None for ops without data)
    handle: Handle
    finish: Callable[[Any], Any] = field(default=lambda v: v)  # maps the host result
    call_id: int = 0     # the call's number on this rank, a part of a group (Request.call_id)
    group: str = ""      # a part of a group: the call's name
    abandoned: bool = False  # its group failed at another part: nobody waits for it


def error_from_proto(err: pb.Error) -> DDLError:
    """The typed exception for a wire Error."""
    fatal = _FATAL_KINDS.get(err.kind)
    if fatal is not None:
        return fatal(err.message, op=err.op, name=err.name, seq=err.seq, rank=err.origin_rank,
                     host=err.origin_host, pid=err.origin_pid, cause=err.cause)
    if err.kind == pb.MISMATCH:
        return MismatchError(err.message, op=err.op, name=err.name, seq=err.seq,
                             rank_a=err.rank_a, value_a=err.value_a, rank_b=err.rank_b,
                             value_b=err.value_b)
    return InvalidRequestError(err.message, op=err.op, name=err.name, seq=err.seq)


def _ready_marks(response: pb.Response) -> None:
    """The Timeline's per-rank ready marks of ``response``'s tensors: each member's tick
    where it submitted the name, from how long the leader says it then waited for the
    last one (the leader's time of completion is taken as now: the response just came)."""
    now = time.monotonic()
    for t in response.tensors:
        for rank, waited_us in zip(response.member_ranks, t.ready_us):
            if waited_us >= 0:
                timeline.negotiate_tick(t.name, rank, now - waited_us * 1e-6)


class Engine:
    """Submission, ordering and completion of this worker's collectives."""

    def __init__(self, rank: int, execute: Callable[[pb.Response, Dict[str, Entry]], None],
                 send: Callable[[List[pb.Request]], None],
                 on_fatal: Callable[[FatalError], None] = lambda error: None,
                 on_local_failure: Callable[[str], None] = lambda what: None):
        self.rank = rank
        self._on_fatal = on_fatal  # called once, with the first fatal error
        self._on_local_failure = on_local_failure  # this rank broke inside a collective
        # the last rank that left (first-hand, see SECONDARY_DEPARTURE), and why
        self._departure: Optional[FatalError] = None
        self.cache = None  # ddl.runtime.cache.ResponseCache, when the cache runs
        self.cycles = None  # ddl.runtime.cache.CycleRunner
        self._execute = execute
        self._send = send
        self._lock = threading.Lock()
        # (process_set_id, name) -> Entry
        self._pending: Dict[Tuple[int, str], Entry] = {}
        self._calls = itertools.count(1)  # Request.call_id of the groups' parts
        # (process set, name) of responses received and not yet taken by the executor
        self._arrived: set = set()
        # names in flight outside the pending table (the fast lane: see claim)
        self._claimed: set = set()
        self._responses: "queue.Queue" = queue.Queue()
        self._fatal: Optional[FatalError] = None
        self._fatal_event = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ddl-engine", daemon=True)
        self._thread.start()

    # -- submission ------------------------------------------------------------------
    def submit(self, entries: List[Entry], inline: bool = False,
               done: Callable[[], bool] = lambda: False,
               group: str = "") -> Optional[Callable[[], None]]:
        """Register ``entries`` and send their requests in one batch.

        Raises the sticky fatal error if there is one, and DuplicateNameError if a name is
        already in flight on this rank (nothing is sent then). Calls that hit the response
        cache wait for a cycle instead, and the function returned runs cycles in the
        calling thread until they are done: whoever waits for them helps. For calls the
        leader answers it is ``CycleRunner.nudge`` (None without cycles): whoever waits
        for them lets the cycle thread start the cached calls at once. With ``inline`` (a
        blocking call about to wait) the cycle thread is not even woken. ``done()`` stops
        the cycles run for the caller early (its group failed at another part). A request
        with a ``local_error`` always goes to the leader, and this rank votes to drop its
        name's cache slot if it has one. ``group``: the call's name when ``entries`` are
        the parts of one group (named ``group/<path>``); when a part's slot is stale (the
        group changed, e.g. its length), this rank also votes to drop the group's cached
        names this call lacks, which would otherwise wait in cycles for it. The parts of
        a group carry a new Request.call_id.
        """
        keys = [(e.request.process_set_id, e.request.name) for e in entries]
        deadline = None
        while True:
            with self._lock:
                self.raise_if_fatal()
                clash = self._clash(keys)
                if clash is None:
                    call_id = next(self._calls) if group else 0
                    for key, entry in zip(keys, entries):
                        self._pending[key] = entry
                        entry.call_id, entry.group = call_id, group
                    break
                key, earlier = clash
            deadline = deadline or time.monotonic() + SETTLE_WAIT_S
            left = deadline - time.monotonic()
            if earlier is None or left <= 0:
                entry = entries[keys.index(key)]
                raise DuplicateNameError(
                    f"{_dtypes.op_name(entry.request.op)} '{key[1]}': this name is already "
                    f"in flight on rank {self.rank} (process set {key[0]}); wait for the "
                    f"first call or use another name", op=_dtypes.op_name(entry.request.op),
                    name=key[1])
            try:   # its answer comes at once (see _clash): wait for it, then go on
                earlier.handle.wait(left)
            except DDLError:
                pass
        if timeline.active:
            timeline.begin([e.request.name for e in entries], NEGOTIATE)
        cycles = self.cycles
        if cycles is None:
            self._send_entries(entries)
            return None
        to_leader: List[Entry] = []
        cached = []
        for entry in entries:
            call, stale = self.cache.lookup(entry.request)
            if entry.request.local_error and call is not None:
                # an invalid call goes to the leader, and so must the others' cached calls
                # of this name, which would otherwise wait for it in cycles
                call, stale = None, call.slot
            if call is not None:
                cached.append((call, entry))
                continue
            if stale:
                cycles.drop(stale)
                if group:   # and its group's other cached names that this call lacks
                    for slot in self.cache.siblings(group, set(keys)):
                        cycles.drop(slot)
                    group = ""  # once
            to_leader.append(entry)
        if cached:
            cycles.add(cached, notify=not inline)
        if to_leader:
            self._send_entries(to_leader)
        if cached:
            return lambda: cycles.drive(cached, done)
        return cycles.nudge  # whoever waits for the leader's answer runs no cycles

    def claim(self, key: Tuple[int, str]) -> bool:
        """Reserve ``key`` (process set id, name) for a call that runs without an Entry
        (the cycles' fast lane, ``CycleRunner.run_fast``): False if the name is in flight
        on this rank. Raises the sticky fatal error. Release it with :meth:`unclaim`."""
        with self._lock:
            self.raise_if_fatal()
            if key in self._pending or key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def unclaim(self, key: Tuple[int, str]) -> None:
        self._claimed.discard(key)

    def resend(self, entry: Entry) -> None:
        """Send a call that was waiting on a dropped cache slot to the leader."""
        self._send_entries([entry])

    def _send_entries(self, entries: List[Entry]) -> None:
        """Send ``entries``' requests to the leader, a group's parts with their call's
        number (set only now: the response cache compares requests without it)."""
        for entry in entries:
            if entry.call_id:
                entry.request.call_id = entry.call_id
        self._send([e.request for e in entries])

    def abandon(self, entries: List[Entry]) -> None:
        """Nobody waits for ``entries`` any more: the unfinished parts of a group that
        failed at another part. The leader fails those it holds at once and those sent
        later on arrival (Request.call_id); a part waiting in cycles runs if every rank
        votes for it, and is answered by the leader when a dropped slot sends it there.
        A new call of one of their names waits for that answer (:meth:`_clash`)."""
        for entry in entries:
            entry.abandoned = True

    def _clash(self, keys: List[Tuple[int, str]]) -> Optional[Tuple[Tuple[int, str],
                                                                    Optional[Entry]]]:
        """The first of ``keys`` already in flight on this rank (hold ``_lock``), with its
        entry when its answer is known to come at once, else None: an abandoned part of a
        failed group (the leader fails it with its group), or a call whose response has
        arrived but waits behind others for the engine thread (a later blocking call may
        have finished first, in its own thread). :meth:`submit` waits (bounded) for
        those, so a name reused right after is not refused as a duplicate, as in Horovod,
        whose one background thread has finished every earlier call once a later one
        returned. None when no key clashes."""
        seen = set()
        for key in keys:
            if key in self._pending:
                earlier = self._pending[key]
                settles = earlier.abandoned or key in self._arrived
                return key, earlier if settles else None
            if key in self._claimed or key in seen:
                return key, None
            seen.add(key)
        return None

    # -- incoming --------------------------------------------------------------------
    def on_message(self, message: pb.CoordinatorMessage) -> None:
        """Control reader callback: queue responses, act on aborts and warnings."""
        kind = message.WhichOneof("kind")
        if kind == "responses":
            if timeline.active and timeline.mark_cycles:
                timeline.mark_cycle()
            for response in message.responses.responses:
                ps = response.process_set_id
                self._arrived.update((ps, t.name) for t in response.tensors)
                if timeline.active:
                    _ready_marks(response)
                    timeline.begin([t.name for t in response.tensors], QUEUE)
                self._responses.put(response)
        elif kind == "abort":
            self.fail(error_from_proto(message.abort))
        elif kind == "warning" and message.warning.kind == pb.PEER_LOST:
            # a rank left: if the data plane later breaks, this is the likely cause
            # (unless it left only because an earlier departure broke its job)
            departure = error_from_proto(message.warning)
            if self._departure is None or not departure.cause.startswith(SECONDARY_DEPARTURE):
                self._departure = departure
        elif kind == "warning":
            log.warning("ddl rank %d: %s", self.rank, message.warning.message)
        elif kind == "cache_flush" and self.cycles is not None:
            self.cycles.flush()

    def on_lost(self, error: BaseException) -> None:
        """Control reader callback: the stream broke."""
        if self._stopping:
            return
        if not isinstance(error, FatalError):
            error = CoordinatorLostError(f"rank {self.rank}: control stream failed: {error!r}",
                                         cause=type(error).__name__)
        self.fail(error)

    # -- fatal errors ----------------------------------------------------------------
    def fail(self, error: FatalError) -> None:
        """Make ``error`` sticky and fail every pending handle with it (first one wins)."""
        with self._lock:
            first = self._fatal is None
            if first:
                error.failed_at = time.monotonic()  # ddl.elastic: how long unwinding took
                self._fatal = error
                self._fatal_event.set()
            error = self._fatal
            pending, self._pending = list(self._pending.values()), {}
        if first and not self._stopping:
            self._on_fatal(error)
        for entry in pending:
            entry.handle._set_error(error)
        self._responses.put(None)  # wake the executor

    def raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    check_abort = raise_if_fatal  # the data plane's abort callback

    def wait_fatal(self, timeout: float) -> Optional[FatalError]:
        """The fatal error, waiting up to ``timeout`` s for one (None if none came)."""
        self._fatal_event.wait(timeout)
        return self._fatal

    @property
    def fatal(self) -> Optional[FatalError]:
        return self._fatal

    # -- execution -------------------------------------------------------------------
    def _take(self, response: pb.Response) -> Dict[str, Entry]:
        with self._lock:
            taken = {}
            for t in response.tensors:
                entry = self._pending.pop((response.process_set_id, t.name), None)
                if entry is not None:
                    taken[t.name] = entry
            if response.op == pb.ADD_PROCESS_SET and not taken:
                # the request was keyed by set 0; the response names the new set
                for t in response.tensors:
                    entry = self._pending.pop((0, t.name), None)
                    if entry is not None:
                        taken[t.name] = entry
            return taken

    def _run(self) -> None:
        from ddl.dataplane.transports import shm
        shm.run_in_background()
        while True:
            response = self._responses.get()
            if response is None:
                if self._stopping or self._fatal is not None:
                    return
                continue
            if self._fatal is not None:
                return
            entries = self._take(response)
            ps = response.process_set_id
            self._arrived.difference_update((ps, t.name) for t in response.tensors)
            if response.HasField("error") and response.error.kind != pb.ERROR_KIND_UNSPECIFIED:
                error = error_from_proto(response.error)
                if isinstance(error, FatalError):
                    self._fail_taken(error, entries)
                    return
                for entry in entries.values():
                    entry.handle._set_error(error)
                continue
            if self.cache is not None:
                self.cache.insert(response, entries)  # before any handle completes
            if not self.run_response(response, entries, self._execute):
                return

    def take(self, response: pb.Response) -> Dict[str, Entry]:
        """Remove and return the pending entries ``response`` answers."""
        return self._take(response)

    def cycle_error(self, exc: BaseException) -> None:
        """The cache cycles ended with ``exc``: fatal for this rank's job."""
        if not isinstance(exc, FatalError):
            # this rank broke in a cycle (a bug, MemoryError): its peers may be stuck in
            # the same exchange, so tell them now, as run_response does
            self._on_local_failure(f"in the response cache's cycles: {exc!r}")
            exc = StallError(f"rank {self.rank}: cached calls could not complete: {exc!r}",
                             cause=type(exc).__name__)
        self._fatal_event.wait(ROOT_CAUSE_WAIT_S)
        self.fail(self._departure or exc)

    def run_response(self, response: pb.Response, entries: Dict[str, Entry],
                     execute: Callable[[pb.Response, Dict[str, Entry]], None]) -> bool:
        """Execute ``response`` for ``entries``; False once the job is fatal."""
        try:
            execute(response, entries)
        except FatalError as exc:
            # The data plane sees a peer vanish as a broken connection, often before
            # the coordinator's abort arrives with the root cause (e.g. that peer's
            # coordinator died). Give the control plane a moment to name it.
            self._fatal_event.wait(ROOT_CAUSE_WAIT_S)
            if timeline.active:
                timeline.end(list(entries), {"error": type(exc).__name__})
            self._fail_taken(self._departure or exc, entries)
            return False
        except Exception as exc:  # a local failure: fail these entries, name the cause
            log.exception("ddl rank %d: executing %s failed", self.rank,
                          _dtypes.op_name(response.op))
            err = exc if isinstance(exc, DDLError) else DDLError(
                f"{_dtypes.op_name(response.op)} (#{response.seq}) failed on rank "
                f"{self.rank}: {exc!r}", op=_dtypes.op_name(response.op), seq=response.seq)
            for entry in entries.values():
                entry.handle._set_error(err)
            if not isinstance(exc, DDLError):
                # peers may be stuck mid-collective with us; the job cannot go on safely
                self._on_local_failure(f"inside {_dtypes.op_name(response.op)} "
                                       f"#{response.seq}: {exc!r}")
                self.fail(PeerLostError(
                    f"rank {self.rank} failed inside {_dtypes.op_name(response.op)} "
                    f"#{response.seq}: {exc!r}", op=_dtypes.op_name(response.op),
                    seq=response.seq, rank=self.rank, cause=repr(exc)))
                return False
        return True

    def _fail_taken(self, error: FatalError, taken: Dict[str, Entry]) -> None:
        """A fatal error while executing ``taken`` (no longer pending): fail them with the
        sticky error too."""
        self.fail(error)
        error = self._fatal or error
        for entry in taken.values():
            entry.handle._set_error(error)  # no-op for a handle already finished

    def stop(self, timeout: float = 2.0) -> None:
        """Fail what is pending with ShutdownError and stop the executor."""
        self._stopping = True
        self.fail(ShutdownError(f"ddl was shut down on rank {self.rank} while this call was "
                                f"pending", rank=self.rank, cause="shutdown"))
        self._thread.join(timeout)

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)


def now() -> float:
    return time.monotonic()
