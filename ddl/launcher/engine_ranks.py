"""One rank of a job that a cluster engine starts (``ddl.spark``, ``ddl.ray``): the engine
runs one task or actor per rank, and each starts its rank as a fresh Python process
(``python -m ddl.launcher._fn_worker``: the pickled call through an inherited pipe,
never argv or the environment) that finds its job from the environment
(:mod:`ddl.startup.tcp_rendezvous`). The engine's driver then names the failure that came
first, the same way for every engine.

A rank's result is unpickled where it ran, from its own child's pipe (as ``ddl.run``
does); what crosses the network back to the driver is the engine's business (Spark's and
Ray's own serialization), never bytes that ddl unpickles.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from typing import Any, List, Mapping, Optional, Sequence, Tuple

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
    return run_process(payload, rank, env, {
        "DDL_RANK": str(rank), "DDL_SIZE": str(size), "DDL_JOB_SECRET": secret,
        "DDL_RENDEZVOUS_ADDR": rendezvous, "DDL_START_TIMEOUT": str(start_timeout)})


def run_process(payload: bytes, rank: int, env: Optional[Mapping[str, str]],
                job_env: Mapping[str, str]) -> Row:
    """Run the call of ``payload`` to its end in a child process (which dies with this
    one) whose environment is this process's without its ``DDL_*`` variables, then
    ``env``, then ``job_env`` (how the child finds its job: a fixed rank's rendezvous, or
    an elastic worker's link to its driver); ``rank`` names the row."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    child_env.update(env or {})
    child_env.update(job_env)
    child_env["DDL_LAUNCHER_PID"] = str(os.getpid())
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
    data = reply[0]
    if data[:1] == b"R" and code == 0:
        return rank, 0, pickle.loads(data[1:]), ""
    tb = data[1:].decode("utf-8", "replace") if data[:1] == b"E" else ""
    if code == 0 and not tb:
        tb = "the rank exited without sending a result"
    return rank, code, None, tb


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
