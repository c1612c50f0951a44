"""Die with the launcher: ``PR_SET_PDEATHSIG`` set from inside a child process.

Launchers normally set this between fork and exec (a ``preexec_fn``). That forces a
real ``fork()`` of the launcher, which runs gRPC's fork handlers in the child; when the
launcher has live gRPC state those handlers can abort the child before ``exec``
(grpc/grpc PR #43157). ddl's own Python children (the coordinator daemon and the
``ddl.run`` worker) therefore call :func:`die_with_launcher` first thing instead, and
are spawned without a ``preexec_fn``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

_PR_SET_PDEATHSIG = 1


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
