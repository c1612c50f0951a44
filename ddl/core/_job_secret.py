"""The job secret's custody: ``DDL_JOB_SECRET`` is taken out of the process's
environment on first sight and held here, so that the processes a worker starts do not
inherit it.
"""

from __future__ import annotations

import os
from typing import Optional

SECRET_VAR = "DDL_JOB_SECRET"
_held_secret: Optional[str] = None  # the job secret, once moved out of os.environ


def _scrub(name: str) -> None:
    """Overwrite the value of ``name`` where libc keeps it (for the launcher's variables:
    the process's initial environment block, which ``/proc/PID/environ`` shows)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        addr = libc.getenv(name.encode())
        if addr:
            ctypes.memset(addr, ord("0"), len(ctypes.string_at(addr)))
    except (OSError, AttributeError, TypeError):  # no libc to ask: the unsetenv still holds
        pass


def take_job_secret() -> Optional[str]:
    """The job secret of this process, moved out of its environment on first sight.

    ``DDL_JOB_SECRET`` is removed from ``os.environ`` (and its bytes in the initial
    environment block are overwritten), so processes that a worker starts (data-loader
    workers, shell commands) do not inherit it; ddl keeps it in this module. A secret set
    in ``os.environ`` later replaces the one held."""
    global _held_secret
    if os.environ.get(SECRET_VAR) is not None:
        _held_secret = os.environ[SECRET_VAR]
        _scrub(SECRET_VAR)
        os.environ.pop(SECRET_VAR, None)
    return _held_secret
