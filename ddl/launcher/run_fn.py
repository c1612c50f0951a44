"""``ddl.run(fn, np=N)``: run a function on N local ranks and return every result.

Uses the same :class:`~ddl.launcher._job.Job` as ``ddlrun``. The function and its
arguments are pickled (cloudpickle when available) and handed to each rank only through
an inherited pipe; each rank answers through another pipe.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ddl.core import config as _config
from ddl.core.errors import DDLError
from ddl.launcher._hosts import assign, parse_hostfile, parse_hosts
from ddl.launcher._job import Job, LaunchError
from ddl.launcher._multihost import is_local

_OUTPUT_DRAIN_S = 5.0


class RunError(DDLError):
    """A rank of :func:`ddl.run` failed. ``rank`` (``-1``: the coordinator), ``exitcode``
    (shell-style) and ``traceback`` (the failing rank's traceback text, or ``""``)."""

    def __init__(self, message: str, *, rank: int, exitcode: int, traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback


def _dumps(obj) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def _write(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BrokenPipeError:
        pass  # the rank died before reading; the job reports that


def _read(fd: int, replies: Dict[int, bytes], rank: int) -> None:
    with os.fdopen(fd, "rb") as f:
        replies[rank] = f.read()


def _local_hosts(hosts: Optional[str], hostfile: Optional[str], np: int) -> None:
    """Check ``hosts``/``hostfile`` (``horovod.run``'s): this machine only, with a slot
    for each of the ``np`` ranks."""
    if hosts is not None and hostfile is not None:
        raise ValueError("ddl.run: pass hosts or hostfile, not both")
    if hosts is None and hostfile is None:
        return
    flag = f"hosts={hosts!r}" if hosts is not None else f"hostfile={hostfile!r}"
    listed = (parse_hosts(hosts, f"ddl.run: {flag}") if hosts is not None
              else parse_hostfile(hostfile))
    remote = sorted({h for h, _ in listed if not is_local(h)})
    if remote:
        raise ValueError(f"ddl.run: {flag} names {', '.join(remote)}, not this machine; "
                         f"ddl.run starts its ranks on this machine only (the function "
                         f"reaches them through pipes): for several hosts, run a script "
                         f"with ddlrun -H")
    assign(listed, np, f"ddl.run: {flag}")


def run(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        np: Optional[int] = None, *, num_proc: Optional[int] = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        start_timeout: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
        executable: Optional[str] = None, verbose: Any = None,
        output_filename: Optional[str] = None, use_gloo: Optional[bool] = None,
        use_mpi: Optional[bool] = None, mpi_args: Optional[str] = None,
        network_interface: Optional[str] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
        min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None,
        cooldown_range: Any = None, min_np: Optional[int] = None,
        max_np: Optional[int] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` local ranks; return the results in rank order.

    Each rank is a fresh Python process under a real coordinator, with ``ddl.init()``
    called before ``fn`` and ``ddl.shutdown()`` after. ``env`` adds variables to the
    ranks' environment. Output is forwarded with ``[rank]<stdout>:`` prefixes. If a rank
    fails, the job is stopped and :class:`RunError` names the rank and carries its
    traceback.

    The keywords are ``horovod.run``'s, so that ``import ddl as horovod`` runs a script's
    ``horovod.run(main, args=(args,), np=..., hosts=..., use_gloo=..., use_mpi=...)``:
    ``num_proc`` is ``np``; ``hosts`` (``"localhost:2"``) and ``hostfile`` may name this
    machine only (the function reaches the ranks through pipes: for several hosts, run a
    script with ``ddlrun -H``); ``executable`` is the ranks' Python; ``verbose`` logs the
    launch; ``output_filename`` writes each rank's output under that folder, as ``ddlrun
    --output-filename``. ``use_gloo``, ``mpi_args``, ``network_interface``, ``ssh_port``,
    ``ssh_identity_file`` and ``disable_cache`` change nothing here, nor do the elastic
    ``max_num_proc``, ``slots``, ``reset_limit`` and ``cooldown_range`` without a minimum;
    ``use_mpi=True`` and ``min_num_proc`` (an elastic job) raise ``ValueError`` saying
    what to use instead.

    Example::

        ranks = ddl.run(lambda: os.environ["DDL_RANK"], np=2)   # ['0', '1']
    """
    del use_gloo, mpi_args, network_interface, ssh_port, ssh_identity_file, disable_cache
    if np is not None and num_proc is not None and np != num_proc:
        raise ValueError(f"ddl.run: np={np!r} and num_proc={num_proc!r} disagree; pass one")
    np = 1 if np is None and num_proc is None else np if np is not None else num_proc
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"ddl.run: np must be an int >= 1, got {np!r}")
    if use_mpi:
        raise ValueError("ddl.run: use_mpi=True asks for mpirun, but ddl.run starts its ranks "
                         "itself and needs no MPI; leave use_mpi unset (or run a script with "
                         "ddlrun --mpi)")
    # as in horovod.run, a minimum makes the job elastic; the other elastic settings
    # change nothing without one
    del max_num_proc, max_np, slots, reset_limit, cooldown_range
    elastic = [k for k, v in (("min_num_proc", min_num_proc), ("min_np", min_np))
               if v is not None]
    if elastic:
        raise ValueError(f"ddl.run: {' and '.join(elastic)} make an elastic job, which "
                         f"ddl.run does not run: run a script with ddlrun --min-np/--max-np "
                         f"(docs/elastic.md)")
    _local_hosts(hosts, hostfile, np)
    base_env = dict(os.environ)
    base_env.update(env or {})
    if start_timeout is None:
        start_timeout = _config.load({k: v for k, v in base_env.items()
                                      if k == "DDL_START_TIMEOUT"}).start_timeout
    else:
        start_timeout = _config.var("DDL_START_TIMEOUT").parse(str(start_timeout))
    payload = _dumps((fn, tuple(args), dict(kwargs or {})))

    pipes = [(os.pipe(), os.pipe()) for _ in range(np)]  # (payload r/w, reply r/w)
    argvs = [[executable or sys.executable, "-m", "ddl.launcher._fn_worker", str(p[0][0]),
              str(p[1][1])] for p in pipes]
    child_fds = [(p[0][0], p[1][1]) for p in pipes]
    job = Job(argvs, start_timeout=start_timeout, env=base_env, pass_fds=child_fds,
              workers_self_pdeathsig=True, log_prefix="ddl.run", verbose=bool(verbose),
              output_dir=output_filename or "")
    replies: Dict[int, bytes] = {}
    threads: List[threading.Thread] = []
    try:
        try:
            job.start()
        finally:
            for fds in child_fds:
                for fd in fds:
                    os.close(fd)
            started = len([r for r in job.pids if r >= 0])
            for rank in range(started, np):  # never started: close our ends too
                os.close(pipes[rank][0][1])
                os.close(pipes[rank][1][0])
        for rank, ((_, w), (r, _)) in enumerate(pipes):
            threads.append(threading.Thread(target=_write, args=(w, payload), daemon=True))
            threads.append(threading.Thread(target=_read, args=(r, replies, rank), daemon=True))
        for t in threads:
            t.start()
        result = job.wait()
    except LaunchError as exc:
        raise RunError(f"ddl.run: {exc}", rank=-1, exitcode=1) from None
    finally:
        job.close()
    for t in threads:
        t.join(_OUTPUT_DRAIN_S)

    if result.summary:
        rank = -1 if result.failed_rank is None else result.failed_rank
        reply = replies.get(rank, b"")
        tb = reply[1:].decode("utf-8", errors="replace") if reply[:1] == b"E" else ""
        message = f"ddl.run: {result.summary}"
        if tb:
            message += f"\nrank {rank} traceback:\n{tb.rstrip()}"
        raise RunError(message, rank=rank, exitcode=result.exit_code, traceback=tb)
    results = []
    for rank in range(np):
        reply = replies.get(rank, b"")
        if reply[:1] != b"R":
            raise RunError(f"ddl.run: rank {rank} exited with code 0 but sent no result",
                           rank=rank, exitcode=0)
        results.append(pickle.loads(reply[1:]))
    return results
