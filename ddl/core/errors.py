"""ddl's exception hierarchy.

Every error ddl raises is a :class:`DDLError`. Subclasses carry fields (``rank``,
``name``, ``op``, ...) so callers and tests can act on them without parsing messages,
and every message names what was wrong and who was involved.

Cross-rank contract: a :class:`MismatchError` is raised on every rank that took part in
the failed call, and the job stays usable. :class:`PeerLostError`,
:class:`CoordinatorLostError`, :class:`StallError` and :class:`ShutdownError` are
fatal and sticky: once one is raised, every pending and later call on that rank raises
the same error.
"""

from __future__ import annotations

import copy as _copy
from typing import Optional


class DDLError(RuntimeError):
    """Base class of every error raised by ddl."""

    def __init__(self, message: str, *, op: str = "", name: str = "", seq: int = 0):
        super().__init__(message)
        self.message = message
        self.op = op
        self.name = name
        self.seq = seq


class ConfigError(DDLError, ValueError):
    """A ``DDL_*`` variable or a launcher flag has a bad value.

    ``variable`` names the variable (or flag) and ``value`` holds the rejected text.
    """

    def __init__(self, message: str, *, variable: str = "", value: str = ""):
        super().__init__(message)
        self.variable = variable
        self.value = value


class NotInitializedError(DDLError):
    """A ddl call was made before :func:`ddl.init` (or after :func:`ddl.shutdown`)."""

    def __init__(self, message: str = "ddl is not initialized; call ddl.init() first"):
        super().__init__(message)


class DuplicateNameError(DDLError, ValueError):
    """The same tensor name was submitted twice on one rank while the first was in flight."""


class MismatchError(DDLError, ValueError):
    """Ranks disagreed on a collective (op, dtype, shape, reduce op, root, scale).

    ``rank_a``/``value_a`` and ``rank_b``/``value_b`` name two disagreeing ranks and what
    each sent. Raised on every participating rank; the job stays usable.
    """

    def __init__(self, message: str, *, op: str = "", name: str = "", seq: int = 0,
                 rank_a: int = -1, value_a: str = "", rank_b: int = -1, value_b: str = ""):
        super().__init__(message, op=op, name=name, seq=seq)
        self.rank_a = rank_a
        self.value_a = value_a
        self.rank_b = rank_b
        self.value_b = value_b


class InvalidRequestError(DDLError, ValueError):
    """A request is invalid on its own (e.g. a root rank outside the process set, an
    unsupported dtype). Raised on every member of the call, with the same text naming the
    rank and what it passed, also when only one rank's argument was bad; the job stays
    usable."""


class FatalError(DDLError):
    """Base of the sticky errors: after one, every later call raises it again."""

    def __init__(self, message: str, *, op: str = "", name: str = "", seq: int = 0,
                 rank: int = -1, host: str = "", pid: int = 0, cause: str = ""):
        super().__init__(message, op=op, name=name, seq=seq)
        self.rank = rank
        self.host = host
        self.pid = pid
        self.cause = cause
        # when this rank's engine made it its job's error (time.monotonic()), or None
        self.failed_at: Optional[float] = None


# Horovod's name for the error of a collective that failed because the job did (a rank
# lost, a coordinator gone, a stall): what its elastic loop recovers from, as ddl.elastic
# recovers from FatalError, so ``except hvd.HorovodInternalError`` catches ddl's.
HorovodInternalError = FatalError


class PeerLostError(FatalError):
    """Another rank died, exited, or stopped answering. ``rank``/``host``/``pid`` name it."""


class CoordinatorLostError(FatalError):
    """The coordinator this worker talks to died or stopped answering."""


class StallError(FatalError):
    """Some ranks never submitted a tensor that others are waiting on."""


class ShutdownError(FatalError):
    """The job is shutting down, or ddl was shut down while the call was pending."""


class DDLTimeoutError(DDLError, TimeoutError):
    """A wait passed its deadline (``timeout`` seconds). ``rank`` names the rank waited
    on when one is to blame (e.g. one that never registered in ``ddl.init()``), else -1;
    ``cause`` says what it failed to do."""

    def __init__(self, message: str, *, op: str = "", name: str = "", timeout: float = 0.0,
                 rank: int = -1, cause: str = ""):
        super().__init__(message, op=op, name=name)
        self.timeout = timeout
        self.rank = rank
        self.cause = cause


class BootstrapError(DDLError):
    """The job could not start: a coordinator did not come up, or the ranks met with
    conflicting settings. ``rank`` and ``host`` name where it went wrong."""

    def __init__(self, message: str, *, rank: int = -1, host: str = ""):
        super().__init__(message, op="init")
        self.rank = rank
        self.host = host


class HostsUpdatedInterrupt(DDLError):
    """Raised by ``State.commit()`` / ``check_host_updates()`` on every rank at once when
    the elastic launcher added or released workers since this world formed: the
    ``ddl.elastic.run`` loop catches it, forms the new world and goes on. ``skip_sync``
    is True when workers only left (every survivor holds the committed state already)."""

    def __init__(self, message: str = "the job's hosts changed", *, skip_sync: bool = False):
        super().__init__(message, op="elastic")
        self.skip_sync = skip_sync


class NotEnoughRanksError(DDLError):
    """An elastic job cannot go on: fewer than ``--min-np`` (``min_np``) workers remain
    (``available``) and no host brought more within ``--elastic-timeout``, or the resets
    passed ``--reset-limit``. Raised on every waiting worker; ddlrun exits non-zero."""

    def __init__(self, message: str, *, min_np: int = 0, available: int = 0):
        super().__init__(message, op="elastic")
        self.min_np = min_np
        self.available = available


class MPINotEnabledError(DDLError, ValueError):
    """An MPI query was made in a job that MPI did not start (``ddlrun`` without
    ``--mpi``, ``ddl.run``, or one plain process)."""


class HandshakeError(DDLError):
    """A data-plane connection failed authentication or its fixed header was invalid."""

    def __init__(self, message: str, *, peer: Optional[str] = None,
                 connection_lost: bool = False):
        super().__init__(message)
        self.peer = peer
        self.connection_lost = connection_lost  # closed or reset, not refused by a check


def with_phase(error: DDLError, phase: str) -> DDLError:
    """A copy of ``error`` (same type and fields) whose message starts with ``phase``
    (e.g. "ddl.init() failed on rank 0 while attaching ..."): where this rank was when
    it learned of the failure."""
    copy = _copy.copy(error)
    copy.message = f"{phase}: {error.message}"
    copy.args = (copy.message,)
    return copy
