"""Timeline: a Chrome trace of what each tensor does on this rank.

The file is in the Trace Event Format (a JSON array of events with ``name``, ``ph``,
``ts`` in microseconds, ``pid``, ``tid`` and ``args``) and opens in Perfetto
(ui.perfetto.dev) and ``chrome://tracing``. Every tensor name gets a row of its own (a
Chrome "thread": one ``tid`` per name, named by a ``thread_name`` metadata event), and on
it the phases follow each other::

    NEGOTIATE -> QUEUE -> MEMCPY_IN_FUSION_BUFFER -> ALLREDUCE -> MEMCPY_OUT_FUSION_BUFFER

with an instant *tick* per rank inside NEGOTIATE (:meth:`Timeline.negotiate_tick`) and the
collective's algorithm, transport and size in its ``args``. ``pid`` is whatever the
caller passes to :meth:`Timeline.start` (the rank), so the files of several ranks can be
opened together.

Call sites use the module's :data:`timeline`::

    from ddl.runtime.timeline import timeline
    if timeline.active:
        timeline.begin(names, "ALLREDUCE", {"algorithm": "ring", "transport": "tcp"})

When the timeline is off, ``timeline.active`` is ``False`` and every recording method
returns at once, so an unguarded call costs one method call and one attribute test.

Recording never touches the file: a method appends one tuple to a queue (a
``collections.deque``, safe from any thread) and a writer thread formats and writes what
has been queued every ``flush_interval`` seconds (0.1 s), and on :meth:`Timeline.flush`
and :meth:`Timeline.stop`. A flush writes at most :data:`MAX_BACKLOG` records and drops
the rest, recording how many in a ``TIMELINE_OVERFLOW`` instant event, so a writer that
cannot keep up (a stalled disk) does not grow the queue without bound.

**Crash safety.** The file is valid JSON after every single system call, so a process
killed at any moment, SIGKILL included, leaves a valid file (missing only what was still
queued: at most the last ``flush_interval``): :class:`~ddl.runtime._trace_file.TraceFile`
writes each event inside one page and grows or trims the file by atomic renames; events
are cut to fit a page (oversized ``args`` are replaced by their size,
:mod:`ddl.runtime._trace_events`). A failed write (a full disk) logs a warning and turns
the timeline off. This holds for local Linux filesystems, not for a machine that loses
power.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple, Union

from ddl.runtime._trace_events import _args_json, _event, event_json
from ddl.runtime._trace_file import TraceFile

log = logging.getLogger("ddl")

# Phase names (any string works; these are the ones ddl records).
NEGOTIATE = "NEGOTIATE"
QUEUE = "QUEUE"
MEMCPY_IN_FUSION_BUFFER = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT_FUSION_BUFFER = "MEMCPY_OUT_FUSION_BUFFER"
CYCLE = "CYCLE"  # name of the instant event of mark_cycle()

FLUSH_INTERVAL_S = 0.1
# Most records one flush writes; if more are queued (recording faster than the writer can
# write, or a stalled disk), the rest are dropped and an OVERFLOW instant says how many.
MAX_BACKLOG = 100_000
WRITE_BATCH = 1000  # records formatted at a time
OVERFLOW = "TIMELINE_OVERFLOW"

_now = time.monotonic

# Record kinds (first field of a queued tuple).
_BEGIN, _END, _TICK, _CYCLE = range(4)

Names = Union[str, Iterable[str]]


def _names(names: Names) -> Tuple[str, ...]:
    """``names`` as a tuple: one name, or any iterable of names."""
    return (names,) if isinstance(names, str) else tuple(names)


# -- the writer ------------------------------------------------------------------------

class _Sink:
    """One open timeline file, its per-file state and its writer thread.

    Producers only append tuples to :attr:`records`; everything else (the
    :class:`TraceFile`, the tensor-name-to-tid map, the open phase of each row) belongs
    to :meth:`flush`, which runs under one lock, in the writer thread or in a caller of
    flush/close.
    """

    def __init__(self, path: str, pid: int, mark_cycles: bool, flush_interval: float,
                 on_error: Callable[["_Sink", BaseException], None]):
        self.path = os.path.abspath(path)
        self.pid = int(pid)
        self.mark_cycles = bool(mark_cycles)
        self.records: collections.deque = collections.deque()
        self._flush_interval = flush_interval
        self._on_error = on_error
        self._lock = threading.Lock()
        self._tids: dict = {}      # tensor name -> tid (1, 2, ...; 0 is the process's)
        self._open: dict = {}      # tid -> name of its open phase
        self._last_ns: dict = {}   # tid -> ts of its last B/E event
        now_ns = int(_now() * 1e9)
        first = event_json("M", "process_name", self.pid, 0, now_ns,
                           {"name": f"rank {self.pid}"})
        self._file: Optional[TraceFile] = TraceFile(self.path, first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddl-timeline", daemon=True)
        self._thread.start()

    # -- writer thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self._flush_interval):
            try:
                self.flush()
            except Exception as exc:  # a full disk, or a record that cannot be formatted
                self._on_error(self, exc)
                return

    def flush(self) -> None:
        """Write every record queued so far (at most :data:`MAX_BACKLOG`; the rest are
        dropped, and rows heal at their next :meth:`Timeline.begin`). Raises ``OSError``
        if the file cannot be written (it stays valid, without the failed write)."""
        with self._lock:
            if self._file is None:
                return
            queued = len(self.records)
            todo = min(queued, MAX_BACKLOG)
            while todo > 0:  # in batches, so that a long backlog reaches the disk early
                n = min(todo, WRITE_BATCH)
                todo -= n
                self._file.append(self._format([self.records.popleft() for _ in range(n)]))
            dropped = queued - min(queued, MAX_BACKLOG)
            if dropped:
                for _ in range(dropped):
                    self.records.popleft()
                self._file.append([event_json("i", OVERFLOW, self.pid, 0, int(_now() * 1e9),
                                              {"dropped_records": dropped}, ',"s":"p"')])

    def close(self) -> None:
        """Stop the writer thread, write what is queued, trim and close the file.
        Idempotent; records queued after this are never written."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self.flush()
        except OSError as exc:
            log.warning("ddl timeline %s: final write failed: %s", self.path, exc)
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as exc:
                    log.warning("ddl timeline %s: trimming failed: %s", self.path, exc)
                self._file = None

    def abandon(self) -> None:
        """Forget the file without writing (in a forked child: the file is the parent's)."""
        if self._file is not None:
            self._file.abandon()
        self._file = None

    # -- formatting --------------------------------------------------------------------
    def _tid(self, name: str, out: List[str], ns: int) -> int:
        """The row of tensor ``name``, named by a metadata event the first time."""
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            label = name if len(name) <= 512 else name[:512] + "..."  # fits one event
            out.append(event_json("M", "thread_name", self.pid, tid, ns, {"name": label}))
        return tid

    def _duration_ns(self, tid: int, ns: int) -> int:
        """``ns`` made later than the row's previous B/E event, so that no two begin/end
        events of a row share a timestamp (viewers order ties unpredictably)."""
        last = self._last_ns.get(tid)
        if last is not None and ns <= last:
            ns = last + 1
        self._last_ns[tid] = ns
        return ns

    def _close_phase(self, tid: int, ns: int, args_text: str, out: List[str]) -> None:
        phase = self._open.pop(tid, None)
        if phase is not None:
            out.append(_event("E", phase, self.pid, tid, self._duration_ns(tid, ns), args_text))

    def _format(self, records) -> List[str]:
        """The event texts of ``records``, in order."""
        out: List[str] = []
        pid = self.pid
        for kind, t, names, what, args in records:
            ns = max(round(t * 1e9), 0)
            args_text = _args_json(args) if args else ""
            if kind == _BEGIN:
                for name in names:
                    tid = self._tid(name, out, ns)
                    self._close_phase(tid, ns, "", out)
                    out.append(_event("B", what, pid, tid, self._duration_ns(tid, ns), args_text))
                    self._open[tid] = what
            elif kind == _END:
                for name in names:
                    tid = self._tids.get(name)
                    if tid is not None:
                        self._close_phase(tid, ns, args_text, out)
            elif kind == _TICK:
                tid = self._tid(names, out, ns)
                out.append(_event("i", str(what), pid, tid, ns, f'{{"rank":{what}}}', ',"s":"t"'))
            elif kind == _CYCLE:
                out.append(_event("i", CYCLE, pid, 0, ns, "", ',"s":"p"'))
        return out


# -- the public object -----------------------------------------------------------------

class Timeline:
    """Records tensor phases into a Chrome-trace file while started.

    Thread-safe: every method may be called from any thread. The recording methods
    (:meth:`begin`, :meth:`end`, :meth:`negotiate_tick`, :meth:`mark_cycle`) take an
    optional time ``t`` in seconds of ``time.monotonic()`` (default: now); events land in
    the file in the order of the calls, which must be the order of their times for one
    tensor (ticks excepted). They never raise and never block on I/O.
    """

    def __init__(self) -> None:
        self.active = False  # read by call sites: `if timeline.active: ...`
        self._sink: Optional[_Sink] = None
        self._switch = threading.Lock()   # serializes start/stop, held while closing
        self._control = threading.Lock()  # guards swapping _sink; never held while waiting
        _instances.add(self)

    # -- control -----------------------------------------------------------------------
    def start(self, path: str, *, pid: int = 0, mark_cycles: bool = False,
              flush_interval: float = FLUSH_INTERVAL_S) -> None:
        """Start writing to ``path`` (replaced if it exists; parents are made), events
        with ``"pid": pid``. ``mark_cycles`` enables :meth:`mark_cycle`. If a timeline is
        already being written, it is finished and closed as by :meth:`stop` (after the
        new file is created, unless both are the same path): a record made before
        ``start`` returns, by the caller's thread, is in the old file; one made after,
        in the new one; one racing with ``start`` in another thread lands in either or
        is dropped. Raises ``OSError`` if the file cannot be created (then a timeline
        being written to another path goes on). Two :class:`Timeline` objects must not
        write the same path."""
        if flush_interval <= 0:
            raise ValueError("flush_interval must be > 0")
        with self._switch:
            old = self._sink
            if old is not None and old.path == os.path.abspath(path):
                self._swap(None)
                old.close()  # its last rename must not land on the new file
                old = None
            sink = _Sink(path, pid, mark_cycles, flush_interval, self._failed)
            self._swap(sink)
            _register_atexit()
            if old is not None:
                old.close()

    def stop(self) -> None:
        """Write everything recorded so far, close the file and turn recording off.
        Idempotent. Phases still open stay open in the file (viewers show them as not
        ended)."""
        with self._switch:
            sink = self._swap(None)
            if sink is not None:
                sink.close()

    def _swap(self, sink: Optional[_Sink]) -> Optional[_Sink]:
        """Make ``sink`` the current one (``None``: off); returns the previous one."""
        with self._control:
            old, self._sink = self._sink, sink
            self.active = sink is not None
            return old

    def flush(self) -> None:
        """Write everything recorded so far now (the writer thread does it every
        ``flush_interval`` anyway). If the write fails, the timeline is turned off (the
        file stays valid) and the error (``OSError``) raised."""
        sink = self._sink
        if sink is None:
            return
        try:
            sink.flush()
        except Exception as exc:
            self._failed(sink, exc)
            raise

    @property
    def path(self) -> Optional[str]:
        """Absolute path of the file being written, or ``None`` when off."""
        sink = self._sink
        return None if sink is None else sink.path

    @property
    def mark_cycles(self) -> bool:
        """Whether :meth:`mark_cycle` records (started with ``mark_cycles=True``)."""
        sink = self._sink
        return sink is not None and sink.mark_cycles

    def _failed(self, sink: _Sink, exc: BaseException) -> None:
        """``sink``'s file cannot be written: turn it off (if still current) and close
        it. Called in the writer thread, or by :meth:`flush`."""
        log.warning("ddl timeline %s: write failed, timeline stopped: %s", sink.path, exc)
        with self._control:
            if self._sink is sink:
                self._sink = None
                self.active = False
        sink.close()  # with no lock of ours held: stop() may be joining this thread

    def _forget(self) -> None:
        """In a forked child: off, without touching the parent's file or thread."""
        sink, self._sink = self._sink, None
        self.active = False
        self._switch, self._control = threading.Lock(), threading.Lock()
        if sink is not None:
            sink.abandon()

    # -- recording ---------------------------------------------------------------------
    def begin(self, names: Names, phase: str, args: Optional[Mapping[str, Any]] = None,
              t: Optional[float] = None) -> None:
        """Tensor(s) ``names`` (one name or an iterable, e.g. the tensors of one fused
        response) enter ``phase``; whatever phase each was in ends at the same time.
        ``args`` (copied) appear on the phase in the viewer."""
        sink = self._sink
        if sink is None:
            return
        sink.records.append((_BEGIN, _now() if t is None else t, _names(names), phase,
                             dict(args) if args else None))

    def end(self, names: Names, args: Optional[Mapping[str, Any]] = None,
            t: Optional[float] = None) -> None:
        """The open phase of each of ``names`` ends (the tensor is done); ``args`` (e.g.
        an error) are added to it. A name with no open phase is ignored."""
        sink = self._sink
        if sink is None:
            return
        sink.records.append((_END, _now() if t is None else t, _names(names), None,
                             dict(args) if args else None))

    def negotiate_tick(self, name: str, rank: int, t: Optional[float] = None) -> None:
        """Rank ``rank`` reported tensor ``name`` ready at ``t``: an instant event named
        after the rank on the tensor's row (times from another host must be converted to
        this process's monotonic clock first)."""
        sink = self._sink
        if sink is None:
            return
        sink.records.append((_TICK, _now() if t is None else t, name, int(rank), None))

    def mark_cycle(self, t: Optional[float] = None) -> None:
        """An instant ``CYCLE`` event across this rank's rows, if started with
        ``mark_cycles=True``."""
        sink = self._sink
        if sink is None or not sink.mark_cycles:
            return
        sink.records.append((_CYCLE, _now() if t is None else t, None, None, None))


# -- process-wide plumbing ---------------------------------------------------------------

_instances: "weakref.WeakSet[Timeline]" = weakref.WeakSet()
_atexit_done = False


def _register_atexit() -> None:
    """Once per process: stop every timeline at interpreter exit, so the last
    ``flush_interval`` of events is written."""
    global _atexit_done
    if not _atexit_done:
        _atexit_done = True
        atexit.register(_stop_all)


def _stop_all() -> None:
    for tl in list(_instances):
        try:
            tl.stop()
        except Exception:  # exit must go on
            pass


def _after_fork_in_child() -> None:
    for tl in list(_instances):
        tl._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)

timeline = Timeline()
"""The process's timeline; ``ddl.start_timeline``/``ddl.stop_timeline`` drive it."""

__all__ = ["Timeline", "timeline", "event_json", "NEGOTIATE", "QUEUE",
           "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "CYCLE", "OVERFLOW",
           "FLUSH_INTERVAL_S", "MAX_BACKLOG"]
