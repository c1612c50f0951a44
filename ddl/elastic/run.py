"""``ddl.elastic.run``: run a training function until it returns, forming a new world of
workers whenever one is lost or ddlrun adds some.

Cross-rank contract: every worker of the job calls the decorated function with its own
:class:`~ddl.elastic.state.State`. When a collective fails because a rank or a
coordinator was lost (:class:`~ddl.core.errors.PeerLostError`,
:class:`~ddl.core.errors.CoordinatorLostError`, or a
:class:`~ddl.core.errors.ShutdownError` from a coordinator whose worker died), each
survivor rolls its state back to the last commit, leaves the broken world, and joins
the next one that ddlrun forms from every live worker (new ranks, new coordinators, new
data-plane links, an empty response cache); then the reset callbacks run, rank 0's state
is broadcast (``sync``), and the function is called again. A
:class:`~ddl.core.errors.HostsUpdatedInterrupt` (raised by ``commit()`` on every rank at
once) does the same without the rollback.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional

from ddl.core.errors import (BootstrapError, CoordinatorLostError, DDLTimeoutError,
                             HostsUpdatedInterrupt, PeerLostError, ShutdownError)
from ddl.runtime import runtime as _runtime
from ddl.startup import elastic_link as _link

log = logging.getLogger("ddl.elastic")

# what a lost world looks like from a survivor: its collectives fail by name
_LOST = (PeerLostError, CoordinatorLostError)
# ... and what the next world's start-up may raise when yet another worker drops out
_START_FAILED = _LOST + (BootstrapError, DDLTimeoutError)

# worlds in a row that fail while starting before this worker gives up (ddlrun's
# --elastic-timeout and --reset-limit bound the rest)
MAX_FAILED_STARTS = 10
# a training function that takes longer than this to hand a failure back is named
SLOW_UNWIND_S = 1.0


def _world_ended(exc: BaseException) -> bool:
    """Whether ``exc`` says this worker's world is over while the worker is not: a lost
    rank or coordinator, or a ShutdownError this worker did not cause (ddl is still
    initialized here). Each world's coordinators are started by its workers and die with
    them, so a killed worker takes its coordinator down, and that coordinator tells the
    ranks it served that the job is shutting down (ShutdownError): for them the world,
    not the job, ended. (When ddlrun really stops the job, it stops every worker, and a
    worker's join finds ddlrun gone.)"""
    if isinstance(exc, _LOST):
        return True
    return isinstance(exc, ShutdownError) and _runtime.is_initialized()


def _reset(cause: Optional[BaseException]) -> None:
    lost = []
    if isinstance(cause, PeerLostError) and cause.rank >= 0:
        lost.append(cause.rank)
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else "hosts updated"
    _link.note_failure(lost, reason)
    _runtime.leave_world("elastic reset: " + reason)
    _runtime.init()


def _unwind_note(exc: BaseException) -> str:
    """How long the failure took to come back out of the training function, when that
    is long enough to matter: the next world waits for this worker meanwhile."""
    failed_at = getattr(exc, "failed_at", None)
    took = time.monotonic() - failed_at if failed_at is not None else 0.0
    if took < SLOW_UNWIND_S:
        return ""
    return (f" (it took {took:.1f} s to come out of the training function, which the next "
            f"world waited for: what the function's frames let go of on their way out, "
            f"e.g. a tf.data iterator, whose autotuning thread TensorFlow may wait up to "
            f"60 s for; see ddl.tensorflow.elastic)")


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``@ddl.elastic.run def train(state, ...)``; call ``train(state, ...)``
    on every worker after ``ddl.init()``. Outside an elastic job (no ``ddlrun
    --min-np/--max-np``) it syncs the state and calls ``func`` once, and failures
    propagate as usual."""

    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        reset, skip_sync, failed_starts = False, False, 0
        cause: Optional[BaseException] = None
        while True:
            resetting = reset
            try:
                if reset:
                    _reset(cause)
                    state.on_reset()
                resetting = False
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                if _link.current() is None:
                    raise
                log.info("ddl.elastic: %s; forming a new world", exc)
                skip_sync, cause = exc.skip_sync, None
            except _START_FAILED + (ShutdownError,) as exc:
                link = _link.current()
                starting = resetting and not isinstance(exc, ShutdownError)
                if link is None or link.closed or not (_world_ended(exc) or starting):
                    raise
                failed_starts = failed_starts + 1 if resetting else 0
                if failed_starts >= MAX_FAILED_STARTS:
                    raise
                log.warning("ddl.elastic: %s: %s; rolling back to the last commit%s%s",
                            type(exc).__name__, str(exc).splitlines()[0][:300],
                            " (a coordinator of this world stopped, which ends the "
                            "world, not the job)" if isinstance(
                                exc, ShutdownError) else "", _unwind_note(exc))
                state.restore()
                skip_sync, cause = False, exc
            reset = True

    return wrapper
