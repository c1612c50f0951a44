"""Die with the parent: ``PR_SET_PDEATHSIG``, the one place ddl sets it.

Two ways, one rule (SIGKILL when the parent dies; die at once if it already has):

- :func:`preexec_die_with_parent`: a ``preexec_fn`` for a child that is not ddl's own
  program (a user's command). It forces a real ``fork()`` of the parent.
- :func:`die_with_launcher`: called first thing by ddl's own Python children (the
  coordinator daemon and the ``ddl.run`` worker), which are spawned without a
  ``preexec_fn``, so the launcher's process is not forked with its live gRPC state. (A
  fork runs gRPC's fork handlers in the child, which could abort it before ``exec``,
  grpc/grpc#43055; ``import ddl`` turns those handlers off, see ``ddl/__init__.py``, so
  this is a second line of defence and saves a fork.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
from typing import Callable

_PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=None)
def load_prctl():
    """libc's ``prctl`` (Linux), or None."""
    if os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def die_with_launcher(launcher_pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to this process when its parent dies (SIGKILL by default; a process
    that cleans up on SIGTERM asks for that); die now if it already has."""
    if launcher_pid <= 0:
        return
    prctl = load_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        os.kill(os.getpid(), sig)


def preexec_die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that gives the child SIGKILL when ``parent_pid`` (the process, in
    fact the thread, that starts it) dies. ``prctl`` is resolved here, in the parent, so
    the code between fork and exec stays minimal."""
    prctl = load_prctl()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
            os.kill(os.getpid(), sigkill)

    return preexec
