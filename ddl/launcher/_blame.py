"""Which process of a job failed first, and how, in words for ``ddlrun``'s last line.

A job's processes fail in cascades: a rank is lost, its coordinator tells the others,
they raise and exit, and a coordinator may exit because of it. :class:`Attribution`
follows the workers' fatal-error reports (:mod:`ddl.core.report`: each names the process
the error came from) from the process that failed first in time to the one that failed
on its own (exited, left with calls in flight, or froze), and says how.

It is mixed into :class:`~ddl.launcher._job.Job`, whose state it reads: ``_procs``
(index -> Popen: ranks >= 0, coordinators < 0), ``_returncodes``, ``_report_dir``,
``_coordinator_hosts``, ``_nodes``, and whose waits it uses (``_await``, ``_frozen``).
"""

from __future__ import annotations

import re
import subprocess
from typing import Dict, List, Optional, Tuple

from ddl.core import report as _report
from ddl.launcher._names import coordinator_index, who
from ddl.launcher._spawn import describe_exit

ORIGIN_EXIT_WAIT_S = 1.0  # a failed rank's report names another: its exit is due this soon


def _first_line(report, with_kind: bool = True) -> str:
    """``Kind: first line of the message`` of a fatal-error report (kind not repeated)."""
    text = report.message.splitlines()[0] if report.message else ""
    if text.startswith(report.kind + ": "):
        text = text[len(report.kind) + 2:]
    return f"{report.kind}: {text}" if with_kind else text


_LOST_PREFIX = re.compile(r"^(?:rank \d+: )?rank \d+ \([^)]*\) was lost[^:]*: ")


def _said_goodbye(report) -> str:
    """Why the origin of a lost-rank report left, when it said so itself on its way out
    (an exit with calls in flight, an uncaught exception); "" otherwise."""
    text = report.cause or _first_line(report, with_kind=False)
    at = text.find("the process exited")
    return text[at:] if at >= 0 else ""


_STOPPED = "its process is stopped"  # the cause the coordinators and ranks give a frozen one


def _lost_cause(report) -> str:
    """What became of the process a report names, without the "rank N (...) was lost: "
    the report's message starts with (ddlrun names that process itself)."""
    return report.cause or _LOST_PREFIX.sub("", _first_line(report, with_kind=False))


class Attribution:
    """The first failure of a job (see the module doc)."""

    _procs: Dict[int, subprocess.Popen]
    _returncodes: Dict[int, int]
    _report_dir: str
    _coordinator_hosts: Dict[int, str]
    _nodes: List[int]

    def _name(self, index: int) -> str:
        """"rank 2 (pid 4242)", "the coordinator (host a, pid 4711)"."""
        host = self._coordinator_hosts.get(index, "")
        where = f"host {host}, " if host else ""
        return f"{who(index)} ({where}pid {self._procs[index].pid})"

    def _origin(self, index: int) -> Tuple[int, str]:
        """The process that failed first, and how: follows the workers' fatal-error
        reports from the failed process ``index`` (a rank that failed because another
        was lost names that one) to a process that failed, left, or froze on its own."""
        if index < 0:  # a coordinator: did a worker record why the job failed?
            reports = [r for r in (_report.read(self._report_dir, i) if self._report_dir
                                   else None for i in sorted(self._procs) if i >= 0) if r]
            named = [r for r in reports if r.origin_rank in self._procs]
            if named:
                return self._origin_of(named[0], {index})
            if reports:
                return index, (f"{self._exited(index)} after rank {reports[0].rank} raised "
                               f"{_first_line(reports[0])}")
            return index, self._exited(index)
        return self._origin_of(None, {index}, index)

    def _origin_of(self, report, seen: set, index: int = -1) -> Tuple[int, str]:
        told = ""  # what the others were told of the process followed to (its goodbye)
        while True:
            if report is None:
                report = _report.read(self._report_dir, index) if self._report_dir else None
                if report is None or report.origin_rank == index and _said_goodbye(report):
                    # no report, or the rank's own record of leaving with calls in flight
                    told = (told or (_said_goodbye(report) if report else "")
                            or self._goodbye_of(index))
                    return index, self._exited(index) + (f" ({told})" if told else "")
            origin = report.origin_rank
            named = self._coordinator_by_pid(report.origin_pid) if origin < 0 else None
            if report.kind == "CoordinatorLostError" or named is not None:
                # a coordinator failed (or stopped the job): name it, dead or frozen
                self._await({i for i in self._procs if i < 0}, ORIGIN_EXIT_WAIT_S,
                            frozen_done=True)
                # a stopped one first: the others exited because of it, it cannot exit
                lost = [i for i in sorted(self._procs, reverse=True) if i < 0 and (
                    self._frozen(i) or self._returncodes.get(i, 0) != 0)]
                lost.sort(key=lambda i: not self._frozen(i))
                blamed = (named if named is not None and (named in lost or not lost)
                          else lost[0] if lost else self._coordinator_of(report.rank))
                if blamed is not None:
                    return blamed, self._coordinator_failure(blamed, report)
            elif 0 <= origin and origin in self._procs and origin not in seen:
                if _STOPPED in _lost_cause(report):
                    # its own process was stopped (SIGSTOP, a debugger): whatever it
                    # raised once thawed (its coordinator gone) came of its loss
                    return origin, f"was lost: {_lost_cause(report)}"
                self._await({origin}, ORIGIN_EXIT_WAIT_S, frozen_done=True)
                seen.add(origin)
                if origin in self._returncodes:  # it exited, with whatever code
                    index, report, told = origin, None, _said_goodbye(report)
                    continue
                # still running (frozen?): name it with what the others were told
                return origin, f"was lost: {_lost_cause(report)}"
            if index < 0:
                return index, self._exited(index)
            return index, f"{self._exited(index)} after raising {_first_line(report)}"

    def _goodbye_of(self, index: int) -> str:
        """Why rank ``index`` left, as it told the others on its way out (their reports
        name it), or ""."""
        if index < 0 or not self._report_dir:
            return ""
        for i in sorted(self._procs):
            r = _report.read(self._report_dir, i) if i >= 0 and i != index else None
            if r is not None and r.origin_rank == index and _said_goodbye(r):
                return _said_goodbye(r)
        return ""

    def _coordinator_by_pid(self, pid: int) -> Optional[int]:
        """The index of the coordinator whose process has ``pid`` (None: none)."""
        found = [i for i, p in self._procs.items() if i < 0 and pid and p.pid == pid]
        return found[0] if found else None

    def _coordinator_of(self, rank: int) -> Optional[int]:
        """The index of the coordinator that serves ``rank`` (None: unknown)."""
        first = 0
        for node, count in enumerate(self._nodes):
            if first <= rank < first + count:
                index = coordinator_index(node)
                return index if index in self._procs else None
            first += count
        return None

    def _coordinator_failure(self, index: int, report) -> str:
        """How coordinator ``index`` failed: its exit (with the reason it gave the
        workers, when it exited on its own), or, still running, what the workers saw."""
        code = self._returncodes.get(index)
        if code is None:
            cause = _lost_cause(report)
            if self._frozen(index) and "stopped" not in cause:
                cause = f"its process is stopped (SIGSTOP or a debugger): {cause}"
            return f"was lost: {cause}"
        how = describe_exit(code)
        if code > 0 and report.cause and report.kind != "CoordinatorLostError":
            how += f": {report.cause}"
        return how

    def _alike(self, index: int, how: str) -> Tuple[int, str]:
        """When rank ``index`` failed on its own and other ranks ended the same way on
        their own (the same exit, no error from the job: a bad argument every rank
        rejects), name the lowest of them and say the others did likewise, rather than
        whichever happened to exit first."""
        code = self._returncodes.get(index)
        same = sorted(i for i in self._procs if i >= 0 and self._returncodes.get(i) == code
                      and not (self._report_dir and _report.read(self._report_dir, i)))
        if len(same) < 2 or index not in same:
            return index, how
        others = ", ".join(str(i) for i in same[1:])
        return same[0], (f"{self._exited(same[0])} (as did rank{'s' if len(same) > 2 else ''} "
                         f"{others})")

    def _exited(self, index: int) -> str:
        code = self._returncodes.get(index)
        return "failed" if code is None else describe_exit(code)
