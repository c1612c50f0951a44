"""Fatal-error reports from workers to their launcher (a local file, never the network).

When a worker's first fatal error is set (:class:`~ddl.runtime.engine.Engine`), it writes
``DDL_REPORT_DIR/fatal.<rank>`` as JSON: the error type, message, and the origin it names
(rank, host, pid). When several processes of a job fail at nearly the same moment, the
launcher reads these reports to tell the root cause (the rank or coordinator that failed
first) from the ranks that failed *because* of it.

The other way round, the launcher records how each worker process ended
(``exit.<rank>``: "exited with code 7", "was killed by signal 9 (SIGKILL)"), and a
coordinator that loses a worker's stream waits briefly for that record so that the error
every rank raises names the cause. Both also look at a live local process's state
(:func:`is_stopped`): a stopped process (SIGSTOP, a debugger) is frozen, not dying.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from dataclasses import dataclass
from typing import Optional

from ddl.core.errors import DDLError


@dataclass(frozen=True)
class Report:
    """What a worker raised: ``kind`` is the exception type name."""

    rank: int
    kind: str
    message: str
    origin_rank: int = -1
    origin_host: str = ""
    origin_pid: int = 0
    cause: str = ""  # what became of the origin, e.g. "its process was killed by ..."


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"fatal.{rank}")


def write(directory: str, rank: int, error: DDLError) -> None:
    """Record ``error`` for ``rank``; never raises (a report is a courtesy)."""
    if not directory:
        return
    body = {"rank": rank, "kind": type(error).__name__, "message": str(error),
            "origin_rank": int(getattr(error, "rank", -1)),
            "origin_host": str(getattr(error, "host", "")),
            "origin_pid": int(getattr(error, "pid", 0)),
            "cause": str(getattr(error, "cause", ""))}
    tmp = _path(directory, rank) + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, _path(directory, rank))
    except OSError:
        pass


REMOTE_PREFIX = b"\x1eddl-report "  # a report relayed on a remote rank's stderr


def relay_line(directory: str, rank: int) -> Optional[bytes]:
    """The stderr line that carries ``rank``'s report from another host (None if none)."""
    try:
        with open(_path(directory, rank), "rb") as f:
            return REMOTE_PREFIX + f.read().replace(b"\n", b" ") + b"\n"
    except OSError:
        return None


def accept_relayed(directory: str, rank: int, line: bytes) -> bool:
    """If ``line`` relays ``rank``'s report, record it here and return True."""
    if not line.startswith(REMOTE_PREFIX):
        return False
    try:
        body = json.loads(line[len(REMOTE_PREFIX):].decode())
        if int(body["rank"]) != rank or not directory:
            return True  # not this rank's: dropped, never shown as output
        tmp = _path(directory, rank) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, _path(directory, rank))
    except (ValueError, KeyError, TypeError, OSError):
        pass
    return True


def read(directory: str, rank: int) -> Optional[Report]:
    """The report of ``rank``, or None if it wrote none (or it is unreadable)."""
    try:
        with open(_path(directory, rank)) as f:
            body = json.load(f)
        return Report(int(body["rank"]), str(body["kind"]), str(body["message"]),
                      int(body.get("origin_rank", -1)), str(body.get("origin_host", "")),
                      int(body.get("origin_pid", 0)), str(body.get("cause", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- exits, recorded by the launcher --------------------------------------------------
def _exit_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"exit.{rank}")


def write_exit(directory: str, rank: int, description: str) -> None:
    """The launcher records how ``rank``'s process ended, e.g. "was killed by signal 9
    (SIGKILL)"; the coordinator quotes it when it tells the others that rank was lost."""
    if not directory:
        return
    tmp = _exit_path(directory, rank) + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(description)
        os.replace(tmp, _exit_path(directory, rank))
    except OSError:
        pass


# -- pids of the processes the launcher started on this host ----------------------------
# ``pid.<rank>`` for a rank (the coordinator tells a rank frozen before it registered from
# a slow one), ``pid.coordinator-<hash of its address>`` for a coordinator (a worker that
# cannot reach it tells a stopped one).
def _pid_file(who) -> str:
    if isinstance(who, int):
        return f"pid.{who}"
    return "pid.coordinator-" + hashlib.sha256(str(who).encode()).hexdigest()[:16]


def write_pid(directory: str, who, pid: int) -> None:
    """Record ``pid`` of ``who``: a rank (int), or a coordinator's address (str)."""
    if not directory:
        return
    path = os.path.join(directory, _pid_file(who))
    try:
        with open(path + ".tmp", "w") as f:
            f.write(str(int(pid)))
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def read_pid(directory: str, who) -> int:
    """The pid recorded for ``who`` (see :func:`write_pid`), or 0."""
    if not directory or who == "":
        return 0
    try:
        with open(os.path.join(directory, _pid_file(who))) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def read_exit(directory: str, rank: int) -> str:
    """How ``rank``'s process ended, or "" if the launcher recorded nothing (yet)."""
    if not directory:
        return ""
    try:
        with open(_exit_path(directory, rank)) as f:
            return f.read(1000)
    except OSError:
        return ""


PF_EXITING = 0x4  # the kernel's task flag (field 9 of /proc/PID/stat): in do_exit()


def process_state(pid: int, count_exiting: bool = False) -> str:
    """The state letter of local process ``pid`` (``R``, ``S``, ``T``, ``Z``...), or ""
    when there is none (or ``pid`` is 0). With ``count_exiting``, a process whose main
    thread is on its way out (``PF_EXITING``: killed, or it called exit) reads ``X``:
    a killed process frees its memory and closes its sockets before it turns zombie,
    so a peer that sees its connection close may still find it ``R`` or ``D``."""
    if pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    return _state(stat, count_exiting)


def _state(stat: bytes, count_exiting: bool = False) -> str:
    """The state letter of a /proc/PID/stat line (see :func:`process_state`)."""
    fields = stat[stat.rfind(b")") + 2:].split()
    state = fields[0][:1].decode("ascii", "replace") if fields else ""
    if count_exiting and state not in ("Z", "X"):
        try:
            if int(fields[6]) & PF_EXITING:
                return "X"
        except (IndexError, ValueError):
            pass
    return state


def is_going(pid: int) -> bool:
    """Whether local process ``pid`` is gone or on its way out: none, a zombie, its main
    thread exiting, or a SIGKILL pending that it has not acted on yet. The last matters
    to a child with a parent-death signal: the threads of a killed process exit one by
    one, the signal comes as the first of them (the one that started the child) exits,
    and until the last one has, the child's parent is still that process."""
    if process_state(pid, count_exiting=True) in ("", "Z", "X"):
        return True
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return True
    kill = 1 << (int(signal.SIGKILL) - 1)
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            try:
                if int(line.split()[1], 16) & kill:
                    return True
            except (IndexError, ValueError):
                pass
    return False


def is_stopped(pid: int) -> bool:
    """Whether local process ``pid`` is stopped (state ``T``: SIGSTOP; ``t``: a
    tracer): it does not run, and answers no signal but SIGKILL until continued."""
    return process_state(pid) in ("T", "t")
