"""Start one child process of a job: its own session, killed if the launcher dies.

Each child gets ``start_new_session=True`` so the launcher can signal the child and
everything it started with one ``killpg`` (:func:`ddl.core.process_group.signal_group`), and
(on Linux) ``PR_SET_PDEATHSIG=SIGKILL`` so that a launcher killed with SIGKILL still takes
its children down. Secrets travel in ``env``, never in ``argv``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Optional, Sequence

from ddl.core.pdeathsig import preexec_die_with_parent


def spawn(argv: Sequence[str], env: Mapping[str, str], *, pass_fds: Sequence[int] = (),
          stdin=subprocess.DEVNULL, merge_stderr: bool = False,
          self_pdeathsig: bool = False, cwd: Optional[str] = None) -> subprocess.Popen:
    """Start ``argv`` with piped binary stdout/stderr in a new session (in ``cwd``, by
    default the launcher's).

    ``self_pdeathsig``: the child is one of ddl's own Python programs and sets its
    parent-death signal itself (see :mod:`ddl.core.pdeathsig`), so no ``preexec_fn`` is used
    and the launcher is not forked with its gRPC state.
    """
    env = dict(env)
    env["DDL_LAUNCHER_PID"] = str(os.getpid())
    return subprocess.Popen(
        list(argv), env=env, stdin=stdin, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        pass_fds=tuple(pass_fds), close_fds=True, start_new_session=True, cwd=cwd,
        preexec_fn=None if self_pdeathsig else preexec_die_with_parent(os.getpid()))


def exit_code(returncode: int) -> int:
    """A shell-style exit status: a death by signal ``s`` becomes ``128 + s``."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by signal 9 (SIGKILL)``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = f" ({signal.Signals(-returncode).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-returncode}{name}"
