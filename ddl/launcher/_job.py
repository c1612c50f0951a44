"""One local job: a coordinator and N workers, watched until they finish or one fails.

Used by both ``ddlrun`` (:mod:`ddl.launcher.cli`) and :func:`ddl.run`.

Lifecycle: :meth:`Job.start` makes a fresh secret and job id, a private (0700) temp dir
for the coordinator's unix socket, starts the coordinator, waits (``start_timeout``) for
its socket, then starts the workers. :meth:`Job.wait` returns when every worker exited 0
(then the coordinator gets 5 s to finish), or on the first failure: a worker exiting
non-zero or by a signal, or the coordinator exiting non-zero while workers run. Then
every process group gets SIGTERM, SIGKILL after 5 s, and the first failure is reported.
:meth:`Job.close` kills whatever is left and removes the temp dir.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl import _auth, _config
from ddl._errors import DDLError
from ddl.launcher._output import Forwarder
from ddl.launcher._spawn import describe_exit, exit_code, signal_group, spawn

COORDINATOR = -1  # index of the coordinator in events and return codes
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL
COORDINATOR_FAIL_GRACE_S = 3.0  # workers' time to report a failure the coordinator saw
COORDINATOR_EXIT_S = 5.0  # deadline for the coordinator after every worker exited 0
COORDINATOR_LINGER_S = 1.0  # ... of which it may take this long before we send SIGTERM
OUTPUT_DRAIN_S = 2.0
# Tests only: a stand-in for ``python -m ddl.server.daemon`` (shlex-split), used while the
# daemon does not exist yet. The launcher appends the same arguments.
TEST_COORDINATOR_CMD = "DDL_TEST_COORDINATOR_CMD"
_UNIX_PATH_MAX = 100


class LaunchError(DDLError):
    """The job could not be started (e.g. the coordinator never became ready)."""


@dataclass
class JobResult:
    """How a job ended. ``exit_code`` is shell-style (signal ``s`` -> ``128 + s``)."""

    exit_code: int
    returncodes: Dict[int, int] = field(default_factory=dict)  # rank (or -1) -> Popen code
    failed_rank: Optional[int] = None  # rank of the first failure; -1: the coordinator
    summary: str = ""  # one line, without the "ddlrun: " prefix; "" on success
    warnings: List[str] = field(default_factory=list)


def _who(index: int) -> str:
    return "the coordinator" if index == COORDINATOR else f"rank {index}"


class Job:
    """A coordinator plus one worker per entry of ``worker_argvs`` on this host."""

    def __init__(self, worker_argvs: Sequence[Sequence[str]], *, start_timeout: float,
                 env: Optional[Mapping[str, str]] = None,
                 extra_env: Optional[Mapping[str, str]] = None,
                 pass_fds: Sequence[Sequence[int]] = (), output_dir: str = "",
                 verbose: bool = False, stdout: Optional[IO[str]] = None,
                 stderr: Optional[IO[str]] = None, rank0_stdin: bool = False,
                 log_prefix: str = "ddlrun", workers_self_pdeathsig: bool = False):
        if not worker_argvs:
            raise ValueError("a job needs at least one worker")
        self.size = len(worker_argvs)
        self._argvs = [list(a) for a in worker_argvs]
        self._pass_fds = [tuple(p) for p in pass_fds] or [()] * self.size
        self._start_timeout = float(start_timeout)
        self._base_env = dict(os.environ if env is None else env)
        self._extra_env = dict(extra_env or {})
        self._output_dir = output_dir
        self._verbose = verbose
        self._stdout = stdout
        self._stderr = stderr
        self._rank0_stdin = rank0_stdin
        self._log_prefix = log_prefix
        # True when the workers are ddl's own Python programs (ddl.run), which set their
        # parent-death signal themselves (see ddl._pdeathsig).
        self._workers_self_pdeathsig = workers_self_pdeathsig
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._procs: Dict[int, subprocess.Popen] = {}
        self._returncodes: Dict[int, int] = {}
        self._forwarder = Forwarder()
        self._stop_signal: Optional[int] = None
        # Set when every worker succeeded and we TERM an idle coordinator: its "aborting"
        # lines would only confuse (shown with verbose).
        self._mute_coordinator = threading.Event()
        self._tmpdir = ""
        self.job_id = _auth.new_job_id()
        self.coordinator_addr = ""

    # -- public -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the coordinator and the workers; raise :class:`LaunchError` on failure."""
        out = self._stdout or sys.stdout
        err = self._stderr or sys.stderr
        secret = _auth.new_secret()
        self._tmpdir = tempfile.mkdtemp(prefix="ddl-")  # mode 0700
        if len(self._tmpdir) > _UNIX_PATH_MAX - len("/coord.sock"):
            os.rmdir(self._tmpdir)
            self._tmpdir = tempfile.mkdtemp(prefix="ddl-", dir="/tmp")
        sock = os.path.join(self._tmpdir, "coord.sock")
        self.coordinator_addr = "unix:" + sock

        common = {k: v for k, v in self._base_env.items() if not self._is_internal(k)}
        common.update(self._extra_env)
        common.update({"DDL_JOB_ID": self.job_id, "DDL_JOB_SECRET": secret})
        common.setdefault("PYTHONUNBUFFERED", "1")

        coord_argv = self._coordinator_argv(common) + [
            "--address", self.coordinator_addr, "--size", str(self.size),
            "--start-timeout", repr(self._start_timeout)]
        coord_env = dict(common, DDL_SIZE=str(self.size))
        self._log(f"starting the coordinator: {self._show(coord_env, coord_argv)}")
        # Its stdout holds only its bound address: shown with --verbose.
        self._launch(COORDINATOR, coord_argv, coord_env, (), subprocess.DEVNULL, False, {
            "stdout": ("[coordinator]<stdout>:", err if self._verbose else None, None),
            "stderr": ("[coordinator]<stderr>:", err, None, self._mute_coordinator)})
        self._wait_for_socket(sock)

        for rank, argv in enumerate(self._argvs):
            env = dict(common)
            env.update(_config.to_env({
                "rank": rank, "size": self.size, "local_rank": rank,
                "local_size": self.size, "coordinator_addr": self.coordinator_addr}))
            files = self._open_rank_files(rank)
            self._log(f"starting rank {rank}: {self._show(env, argv)}")
            stdin = None if (rank == 0 and self._rank0_stdin) else subprocess.DEVNULL
            self._launch(rank, argv, env, self._pass_fds[rank], stdin, False, {
                "stdout": (f"[{rank}]<stdout>:", out, files[0]),
                "stderr": (f"[{rank}]<stderr>:", err, files[1])})

    def wait(self) -> JobResult:
        """Watch the job until it ends; tear it down on the first failure."""
        try:
            return self._watch()
        except BaseException:
            self._teardown()
            raise

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask :meth:`wait` to stop the job (safe to call from a signal handler)."""
        self._stop_signal = signum
        self._events.put(("stop", None, signum))

    def close(self) -> None:
        """Kill every process group that is left, drain output, remove the temp dir."""
        try:
            if any(i not in self._returncodes for i in self._procs):
                self._teardown()
            for proc in self._procs.values():
                signal_group(proc, signal.SIGKILL)  # grandchildren left in the groups
            self._forwarder.join(OUTPUT_DRAIN_S)
        finally:
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = ""

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stop_signal(self) -> Optional[int]:
        """The signal passed to :meth:`stop`, if any."""
        return self._stop_signal

    @property
    def pids(self) -> Dict[int, int]:
        """Rank (``-1``: the coordinator) -> pid of every process started so far."""
        return {i: p.pid for i, p in self._procs.items()}

    # -- starting -------------------------------------------------------------------------
    @staticmethod
    def _is_internal(name: str) -> bool:
        try:
            return _config.var(name).internal
        except KeyError:
            return False

    def _coordinator_argv(self, env: Mapping[str, str]) -> List[str]:
        stand_in = env.get(TEST_COORDINATOR_CMD, "")
        if stand_in:
            return shlex.split(stand_in)
        return [sys.executable, "-m", "ddl.server.daemon"]

    def _launch(self, index, argv, env, pass_fds, stdin, merge_stderr, streams) -> None:
        try:
            own = (self._workers_self_pdeathsig if index != COORDINATOR
                   else argv[:3] == [sys.executable, "-m", "ddl.server.daemon"])
            proc = spawn(argv, env, pass_fds=pass_fds, stdin=stdin, merge_stderr=merge_stderr,
                         self_pdeathsig=own)
        except OSError as exc:
            raise LaunchError(f"cannot start {_who(index)} ({shlex.join(argv)}): "
                              f"{exc.strerror or exc}") from None
        self._procs[index] = proc
        for attr, (prefix, dest, raw, *mute) in streams.items():
            self._forwarder.add(getattr(proc, attr), prefix, dest, raw, *mute)
        threading.Thread(target=self._reap, args=(index, proc), daemon=True,
                         name=f"ddlrun-wait {_who(index)}").start()

    def _reap(self, index: int, proc: subprocess.Popen) -> None:
        self._events.put(("exit", index, proc.wait()))

    def _open_rank_files(self, rank: int):
        if not self._output_dir:
            return None, None
        d = os.path.join(self._output_dir, f"rank.{rank}")
        try:
            os.makedirs(d, exist_ok=True)
            return open(os.path.join(d, "stdout"), "wb"), open(os.path.join(d, "stderr"), "wb")
        except OSError as exc:
            raise LaunchError(f"cannot write output files under {d}: "
                              f"{exc.strerror or exc}") from None

    def _wait_for_socket(self, path: str) -> None:
        deadline = time.monotonic() + self._start_timeout
        while not os.path.exists(path):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchError(
                    f"the coordinator (pid {self._procs[COORDINATOR].pid}) did not create its "
                    f"socket {path} within {self._start_timeout:g} s (--start-timeout)")
            try:
                kind, index, value = self._events.get(timeout=min(0.02, remaining))
            except queue.Empty:
                continue
            if kind == "stop":
                raise LaunchError(f"interrupted by {signal.Signals(value).name} while the "
                                  f"coordinator was starting")
            self._returncodes[index] = value
            raise LaunchError(f"the coordinator (pid {self._procs[index].pid}) "
                              f"{describe_exit(value)} before it was ready")

    # -- watching -------------------------------------------------------------------------
    def _watch(self) -> JobResult:
        running = set(range(self.size)) - set(self._returncodes)
        while running:
            if self._stop_signal is not None:
                return self._fail_by_signal(self._stop_signal)
            try:
                kind, index, value = self._events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "stop":
                return self._fail_by_signal(value)
            self._returncodes[index] = value
            running.discard(index)
            if value != 0 and index == COORDINATOR and running:
                return self._fail(*self._root_cause(running))
            if value != 0 and index != COORDINATOR:
                return self._fail(index, value)
        return self._finish_coordinator()

    def _root_cause(self, running: set) -> Tuple[int, int]:
        """After the coordinator failed: the first worker that fails on its own within
        a short grace period (the coordinator usually fails *because* a worker was lost,
        and the workers then raise and exit), else the coordinator itself."""
        deadline = time.monotonic() + COORDINATOR_FAIL_GRACE_S
        while running and time.monotonic() < deadline:
            try:
                kind, index, value = self._events.get(
                    timeout=max(0.01, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                continue
            if kind != "exit":
                break
            self._returncodes[index] = value
            running.discard(index)
            if value != 0:
                return index, value
        return COORDINATOR, self._returncodes[COORDINATOR]

    def _fail(self, index: int, returncode: int) -> JobResult:
        self._teardown()
        pid = self._procs[index].pid
        return JobResult(exit_code(returncode), dict(self._returncodes), index,
                         f"{_who(index)} (pid {pid}) {describe_exit(returncode)}; "
                         f"the job was stopped")

    def _fail_by_signal(self, signum: int) -> JobResult:
        self._teardown()
        return JobResult(128 + signum, dict(self._returncodes), None,
                         f"received {signal.Signals(signum).name}; the job was stopped")

    def _finish_coordinator(self) -> JobResult:
        result = JobResult(0, {})
        if COORDINATOR not in self._returncodes:
            self._await({COORDINATOR}, COORDINATOR_LINGER_S)
        if COORDINATOR not in self._returncodes:
            # Every worker is gone, so there is nothing left to coordinate.
            if not self._verbose:
                self._mute_coordinator.set()
            signal_group(self._procs[COORDINATOR], signal.SIGTERM)
            self._await({COORDINATOR}, COORDINATOR_EXIT_S - COORDINATOR_LINGER_S)
            if COORDINATOR not in self._returncodes:
                signal_group(self._procs[COORDINATOR], signal.SIGKILL)
                self._await({COORDINATOR}, TERM_GRACE_S)
                result.warnings.append(f"the coordinator (pid {self._procs[COORDINATOR].pid}) "
                                       f"did not exit within {COORDINATOR_EXIT_S:g} s after "
                                       f"every rank finished; it was killed")
        else:
            code = self._returncodes[COORDINATOR]
            if code != 0:
                result.warnings.append(f"the coordinator (pid {self._procs[COORDINATOR].pid}) "
                                       f"{describe_exit(code)} after every rank finished")
        result.returncodes = dict(self._returncodes)
        return result

    def _await(self, indices, timeout: float) -> None:
        """Collect exit events until every index in ``indices`` exited or ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(i not in self._returncodes for i in indices):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                kind, index, value = self._events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if kind == "exit":
                self._returncodes[index] = value

    def _teardown(self) -> None:
        """SIGTERM every process group, SIGKILL survivors after 5 s, reap them."""
        for proc in self._procs.values():
            signal_group(proc, signal.SIGTERM)
        self._await(set(self._procs), TERM_GRACE_S)
        for index, proc in self._procs.items():
            if index not in self._returncodes:
                signal_group(proc, signal.SIGKILL)
        self._await(set(self._procs), TERM_GRACE_S)

    # -- logging --------------------------------------------------------------------------
    def _log(self, text: str) -> None:
        if self._verbose:
            err = self._stderr or sys.stderr
            err.write(f"{self._log_prefix}: {text}\n")
            err.flush()

    def _show(self, env: Mapping[str, str], argv: Sequence[str]) -> str:
        """The command with the DDL_* variables the launcher set, never the secret."""
        shown = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
                 if k.startswith("DDL_") and k != "DDL_JOB_SECRET"
                 and self._base_env.get(k) != v]
        return " ".join(shown + [shlex.join(argv)])
