"""``ddlrun --mpi``: launch the job through the MPI implementation's own ``mpirun``.

ddlrun then starts no coordinator and makes no secret: each rank's ``ddl.init()`` sees
the MPI launcher's environment and bootstraps over ``COMM_WORLD`` (rank 0 makes the
secret and sends it over MPI; see :mod:`ddl.startup.bootstrap`). ddlrun builds the ``mpirun``
argument list (never a shell string), forwards the ``DDL_*`` settings, ``PATH`` and
``PYTHONPATH``, passes signals on, and exits with ``mpirun``'s status.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence

from ddl.core.errors import ConfigError
from ddl.launcher._hosts import parse_hosts

_VERSION_TIMEOUT_S = 10.0


def find_mpirun(environ: Mapping[str, str]) -> str:
    """``mpirun`` (or ``mpiexec``) on ``PATH``; ConfigError when there is none."""
    path = environ.get("PATH", os.defpath)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=path)
        if found:
            return found
    raise ConfigError("--mpi needs mpirun or mpiexec on PATH (Open MPI, MPICH or Intel MPI); "
                      "without --mpi, ddlrun needs no MPI", variable="DDL_MPI", value="1")


def flavor(mpirun: str) -> str:
    """``"openmpi"``, ``"mpich"`` (MPICH, Hydra, Intel MPI) or ``"unknown"``."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=_VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-rte" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return "unknown"


def forwarded_names(environ: Mapping[str, str]) -> List[str]:
    """The variables every rank needs from ddlrun's environment."""
    return sorted(k for k in environ
                  if k.startswith("DDL_") or k in ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED"))


def build_argv(mpirun: str, kind: str, np: int, hosts: str, mpi_args: str,
               command: Sequence[str], env_names: Sequence[str]) -> List[str]:
    """The ``mpirun`` command line for ``kind`` (see :func:`flavor`)."""
    argv = [mpirun, "-np", str(np)]
    if hosts:
        total = sum(slots for _, slots in parse_hosts(hosts))
        if total < np:
            raise ConfigError(f"-H {hosts!r} has {total} slot(s) but -np is {np}",
                              variable="DDL_HOSTS", value=hosts)
        argv += ["-H" if kind == "openmpi" else "-hosts", hosts]
    if kind == "openmpi":  # MPICH's Hydra and Intel MPI forward the whole environment
        for name in env_names:
            argv += ["-x", name]
    try:
        argv += shlex.split(mpi_args)
    except ValueError as exc:
        raise ConfigError(f"--mpi-args {mpi_args!r} cannot be split: {exc}",
                          variable="DDL_MPI_ARGS", value=mpi_args) from None
    return argv + list(command)


def run(np: int, hosts: str, mpi_args: str, command: Sequence[str],
        extra_env: Mapping[str, str], verbose: bool, log_prefix: str) -> int:
    """Run the job under ``mpirun``; returns the exit status for ddlrun."""
    env: Dict[str, str] = dict(os.environ)
    env.update(extra_env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    mpirun = find_mpirun(env)
    kind = flavor(mpirun)
    argv = build_argv(mpirun, kind, np, hosts, mpi_args, command, forwarded_names(env))
    if verbose:
        print(f"{log_prefix}: {kind} launcher: {shlex.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, env=env)
    previous = {s: signal.signal(s, lambda signum, _f: _forward(proc, signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def _forward(proc: Optional[subprocess.Popen], signum: int) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signum)
