"""One rank of a job that a cluster engine starts (``ddl.spark``, ``ddl.ray``): the engine
runs one task or actor per rank, and each starts its rank as a fresh Python process
(``python -m ddl.launcher._fn_worker``: the pickled call through an inherited pipe,
never argv or the environment) that finds its job from the environment
(:mod:`ddl.startup.tcp_rendezvous`). The engine's driver then names the failure that came
first, the same way for every engine.

A rank's result is unpickled where it ran, from its own child's pipe (as ``ddl.run``
does); what crosses the network back to the driver is the engine's business (Spark's and
Ray's own serialization), never bytes that ddl unpickles.

:func:`run_rank` runs one call as a job of its own; :class:`RankServer` keeps a rank up
between calls, its job and its state with it (``ddl.ray.RayExecutor``, as Horovod's
actors keep theirs).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from ddl.launcher._fn_worker import read_frame, write_frame
from ddl.launcher.run_fn import RunError, _dumps

# Failures that are consequences of another rank's (their tracebacks name these)
_SECONDARY = ("PeerLostError", "CoordinatorLostError", "ShutdownError")

# (rank, exit code, result or None, traceback text: "" when the rank returned a result)
Row = Tuple[int, int, Any, str]


def pickle_call(fn, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None) -> bytes:
    """The call a rank runs, as the bytes :func:`run_rank` feeds it (cloudpickle)."""
    return _dumps((fn, tuple(args), dict(kwargs or {})))


def free_port() -> int:
    """A TCP port free on every address of this host now (for rank 0's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_rank(payload: bytes, rank: int, size: int, secret: str, rendezvous: str,
             start_timeout: float, env: Optional[Mapping[str, str]] = None) -> Row:
    """Run one rank to its end in a child process (which dies with this one); the job
    secret goes only into the child's environment."""
    return run_process(payload, rank, env, _job_env(rank, size, secret, rendezvous,
                                                    start_timeout))


def _job_env(rank: int, size: int, secret: str, rendezvous: str,
             start_timeout: float) -> Mapping[str, str]:
    """How a rank of a fixed job finds it (:mod:`ddl.startup.tcp_rendezvous`)."""
    return {"DDL_RANK": str(rank), "DDL_SIZE": str(size), "DDL_JOB_SECRET": secret,
            "DDL_RENDEZVOUS_ADDR": rendezvous, "DDL_START_TIMEOUT": str(start_timeout)}


def _child_env(env: Optional[Mapping[str, str]], job_env: Mapping[str, str]) -> dict:
    """This process's environment without its ``DDL_*`` variables, then ``env``, then
    ``job_env``; the child dies with this process."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    child_env.update(env or {})
    child_env.update(job_env)
    child_env["DDL_LAUNCHER_PID"] = str(os.getpid())
    return child_env


def run_process(payload: bytes, rank: int, env: Optional[Mapping[str, str]],
                job_env: Mapping[str, str]) -> Row:
    """Run the call of ``payload`` to its end in a child process (which dies with this
    one) whose environment is this process's without its ``DDL_*`` variables, then
    ``env``, then ``job_env`` (how the child finds its job: a fixed rank's rendezvous, or
    an elastic worker's link to its driver); ``rank`` names the row."""
    child_env = _child_env(env, job_env)
    fn_r, fn_w = os.pipe()
    reply_r, reply_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ddl.launcher._fn_worker", str(fn_r),
                                 str(reply_w)], env=child_env, pass_fds=(fn_r, reply_w),
                                stdin=subprocess.DEVNULL)
    finally:
        os.close(fn_r)
        os.close(reply_w)
    reply: List[bytes] = [b""]

    def read() -> None:
        with os.fdopen(reply_r, "rb") as f:
            reply[0] = f.read()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with os.fdopen(fn_w, "wb") as f:
            f.write(payload)
    except BrokenPipeError:
        pass  # the rank died first; its exit code says how
    code = proc.wait()
    reader.join(5.0)
    return _row(rank, code, reply[0])


def _row(rank: int, code: int, data: bytes) -> Row:
    """The row of a rank that answered ``data`` (``b"R"`` and its pickled result, or
    ``b"E"`` and a traceback) and whose exit code is ``code`` (0 while it runs on)."""
    if data[:1] == b"R" and code == 0:
        return rank, 0, pickle.loads(data[1:]), ""
    tb = data[1:].decode("utf-8", "replace") if data[:1] == b"E" else ""
    if code == 0 and not tb:
        tb = "the rank exited without sending a result"
    return rank, code, None, tb


class RankServer:
    """Rank ``rank`` of a job of ``size`` that stays up between calls: a child process
    (``python -m ddl.launcher._fn_worker --serve``, which dies with this one) that joins
    the job at once and then runs each :meth:`call` in turn, keeping its modules'
    state, the objects calls leave in them, and its place in the job.

    Cross-rank contract: every rank of the job is a RankServer, started together
    (:meth:`ready` returns once this one joined). A call that raises ends its rank
    after answering (its peers, in a collective with it or in their next one, fail at
    once with a named error instead of waiting for it); so does a call that shut ddl
    down. After any failed call the owner ends every rank (:meth:`stop`) and starts a
    new job: what the ranks kept is gone with them."""

    def __init__(self, rank: int, size: int, secret: str, rendezvous: str,
                 start_timeout: float, env: Optional[Mapping[str, str]] = None):
        self.rank = rank
        calls_r, self._calls = os.pipe()
        self._replies, replies_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ddl.launcher._fn_worker", "--serve", str(calls_r),
                 str(replies_w)], pass_fds=(calls_r, replies_w), stdin=subprocess.DEVNULL,
                env=_child_env(env, _job_env(rank, size, secret, rendezvous, start_timeout)))
        except BaseException:
            os.close(self._calls)
            os.close(self._replies)
            raise
        finally:
            os.close(calls_r)
            os.close(replies_w)

    def ready(self, timeout: float) -> Row:
        """Wait, at most ``timeout`` s, for the rank to join its job: ``(rank, 0, None,
        "")``, or the row of its failure (after which it has ended)."""
        try:
            data = read_frame(self._replies, time.monotonic() + timeout)
        except TimeoutError:
            self.stop(0)
            return (self.rank, 1, None, f"rank {self.rank} did not join its job within "
                    f"{timeout:g} s")
        if data == b"O":
            return self.rank, 0, None, ""
        return _row(self.rank, self._end(), data or b"")

    def call(self, payload: bytes) -> Row:
        """Run the call of ``payload`` (:func:`pickle_call`) to its end: its row. The
        rank ends after a call that failed (its row says how) or that shut ddl down."""
        try:
            write_frame(self._calls, payload)
        except OSError:  # it has ended: its exit code says how
            return _row(self.rank, self._end(), b"")
        data = read_frame(self._replies)
        if data is None or data[:1] == b"E":
            return _row(self.rank, self._end(), data or b"")
        if data[:1] == b"Q":   # its last answer (the call shut ddl down): wait for its end
            return _row(self.rank, self._end(), b"R" + data[1:])
        return _row(self.rank, 0, data)

    def alive(self) -> bool:
        """Whether the rank is still in its job (no call failed, none shut ddl down)."""
        return self._proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """End the rank: it leaves its job as at the end of a program, within
        ``timeout`` s, else it is killed. Safe to call twice."""
        if self._calls >= 0:
            os.close(self._calls)
            self._calls = -1
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._replies >= 0:
            os.close(self._replies)
            self._replies = -1

    def _end(self, timeout: float = 10.0) -> int:
        """The exit code of a rank that is ending by itself (killed if it has not
        within ``timeout`` s)."""
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(0)
            return self._proc.returncode


def results(rows: Sequence[Row], size: int, who: str) -> List[Any]:
    """Every rank's result in rank order, or :class:`RunError` naming the rank whose
    failure came first (one whose traceback is not a consequence of another's, the
    lowest such), the ranks that failed after it, and its traceback."""
    got = {r: (c, value, tb) for r, c, value, tb in rows}
    missing = sorted(set(range(size)) - set(got))
    failed = [(r, c, tb) for r, (c, _, tb) in sorted(got.items()) if c != 0 or tb]
    if not failed and not missing:
        return [got[r][1] for r in range(size)]
    if failed:
        rank, code, tb = min(failed, key=lambda row: (
            any(k in row[2] for k in _SECONDARY), row[0]))
        how = (f"was killed by signal {-code}" if code < 0 else
               "raised" if "Traceback" in tb else f"exited with code {code}" if code else
               "failed")
    else:
        rank, code, tb, how = missing[0], 1, "", "sent no result (its task or actor was lost)"
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    message = f"{who}: rank {rank} {how}" + (f": {last}" if last else "")
    others = sorted(({r for r, _, _ in failed} | set(missing)) - {rank})
    if others:
        message += f" (ranks {others} failed after it)"
    if tb:
        message += f"\nrank {rank} traceback:\n{tb.rstrip()}"
    raise RunError(message, rank=rank, exitcode=code or 1, traceback=tb)
