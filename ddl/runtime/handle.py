"""Handles of asynchronous collectives.

A :class:`Handle` completes once, with a value or an exception. ``wait()`` always has a
deadline: the ``timeout`` given, or the job's collective timeout
(``DDL_COLLECTIVE_TIMEOUT_SECONDS``). A fatal job error completes every pending handle.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

from ddl.core.errors import DDLTimeoutError

_NOT_SET = object()


class Handle:
    """The pending result of an ``*_async`` collective.

    ``poll()`` tells whether it finished; ``wait()`` returns the result or raises the
    collective's error. Both may be called from any thread, any number of times.
    """

    __slots__ = ("op", "name", "_done", "_event", "_value", "_error", "_default_timeout",
                 "_callbacks", "_lock", "_drive")

    def __init__(self, op: str, name: str, default_timeout: float):
        self.op = op
        self.name = name
        self._done = False
        self._event: Optional[threading.Event] = None  # made by the first waiter that blocks
        self._value: Any = _NOT_SET
        self._error: Optional[BaseException] = None
        self._default_timeout = default_timeout
        self._callbacks: List[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()
        # runs a cached call's cycles in the thread that waits for it (see Engine.submit)
        self._drive: Optional[Callable[[], None]] = None

    # -- producer side ----------------------------------------------------------------
    def _set_result(self, value: Any) -> None:
        self._finish(value, None)

    def _set_error(self, error: BaseException) -> None:
        self._finish(_NOT_SET, error)

    def _finish(self, value: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            if self._done:
                return
            self._value, self._error = value, error
            self._done = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def _add_done_callback(self, cb: Callable[["Handle"], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(cb)
                return
        cb(self)

    # -- consumer side ----------------------------------------------------------------
    def poll(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The result; raises the collective's error, or DDLTimeoutError after ``timeout``
        (None: the job's collective timeout; else finite seconds >= 0)."""
        check_timeout(timeout)
        drive = self._drive
        if drive is not None and timeout is None:
            self._drive = None
            drive()
        if not self._done:
            limit = self._default_timeout if timeout is None else timeout
            with self._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if not self._done and not event.wait(limit):
                raise DDLTimeoutError(
                    f"{self.op} '{self.name}' did not finish within {limit:g} s; the call is "
                    f"still in flight (raise DDL_COLLECTIVE_TIMEOUT_SECONDS or pass timeout=)",
                    op=self.op, name=self.name, timeout=limit)
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        state = "done" if self.poll() else "pending"
        return f"<ddl.Handle {self.op} '{self.name}' {state}>"


class GroupHandle(Handle):
    """Completes when all of ``parts`` completed; its value is ``combine(values)``.

    A part's error completes the group at once with that error, without waiting for the
    other parts (a group that other ranks call with fewer arrays fails at its first
    name, while its last names wait for calls that never come), and calls
    ``on_error(error, unfinished)`` once with the parts not yet done, so that they can be
    abandoned (:meth:`ddl.runtime.engine.Engine.abandon`).
    """

    __slots__ = ("_parts", "_combine", "_remaining", "_failed", "_on_error")

    def __init__(self, op: str, name: str, default_timeout: float, parts: Sequence[Handle],
                 combine: Callable[[List[Any]], Any],
                 on_error: Optional[Callable[[BaseException, List[Handle]], None]] = None):
        super().__init__(op, name, default_timeout)
        self._on_error = on_error
        self._parts = list(parts)
        self._combine = combine
        self._remaining = len(self._parts)
        self._failed = False
        if not self._parts:
            self._set_result(combine([]))
            return
        counter_lock = threading.Lock()

        def on_part_done(part: Handle) -> None:
            with counter_lock:
                self._remaining -= 1
                last = self._remaining == 0
                failed = part._error is not None and not self._failed
                self._failed = self._failed or failed
            if failed:   # the parts left are abandoned before a waiter may retry
                if self._on_error is not None:
                    self._on_error(part._error, [p for p in self._parts if not p._done])
                self._set_error(part._error)
            elif last and not self._failed:
                self._complete()

        for part in self._parts:
            part._add_done_callback(on_part_done)

    def _complete(self) -> None:
        for part in self._parts:
            if part._error is not None:
                self._set_error(part._error)
                return
        try:
            self._set_result(self._combine([p._value for p in self._parts]))
        except BaseException as exc:  # a failing combine must not lose the error
            self._set_error(exc)


def check_timeout(timeout: Any) -> None:
    """ValueError naming ``timeout`` unless it is None or a finite number >= 0."""
    if timeout is None:
        return
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
            or not math.isfinite(float(timeout)) or timeout < 0):
        raise ValueError(f"timeout must be None or a finite number of seconds >= 0, not "
                         f"{timeout!r}")


def deadline_after(seconds: float) -> float:
    return time.monotonic() + seconds
