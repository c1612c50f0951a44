"""One job: a coordinator per node and N workers, watched until they finish or one
fails. Nodes are this host (or simulated nodes of it); other hosts are reached over ssh
by the :class:`~ddl.launcher._multihost.MultiHostLaunch` part.

Used by both ``ddlrun`` (:mod:`ddl.launcher.cli`) and :func:`ddl.run`.

Lifecycle: :meth:`Job.start` makes a fresh secret and job id, a private (0700) temp dir
for the coordinators' unix sockets, starts the leader coordinator, waits
(``start_timeout``) for its socket, then the other nodes' coordinators (relays to the
leader over loopback TCP), then the workers. A job has one node unless the test variable
``DDL_TEST_LOCAL_NODES`` (e.g. ``"2,2"``: ranks per node) splits this host into several
simulated nodes, each with its own coordinator and host name. :meth:`Job.wait` returns
when every worker exited 0 (then the coordinator gets 5 s to finish; it is stopped at once
when no rank ever registered, as for ``ddlrun -np 2 hostname``), or on the first failure:
a worker exiting non-zero or by a signal, or the coordinator exiting non-zero while
workers run. Then every process group gets SIGTERM, SIGKILL after 5 s, and the first
failure is reported.
:meth:`Job.close` kills whatever is left and removes the temp dir.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.core import report as _report
from ddl.core.child_env import absolute_pythonpath
from ddl.core.process_group import signal_group
from ddl.launcher._blame import Attribution
from ddl.launcher._multihost import MultiHostLaunch, RemoteSettings, is_local
from ddl.launcher._names import COORDINATOR, LaunchError, coordinator_index, who
from ddl.launcher._output import Forwarder, write_line
from ddl.launcher._spawn import describe_exit, exit_code, spawn

TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL
COORDINATOR_FAIL_GRACE_S = 3.0  # workers' time to report a failure the coordinator saw
FAILURE_GRACE_S = 2.0  # after a failure: the other ranks' time to raise and exit
COORDINATOR_EXIT_S = 5.0  # deadline for the coordinator after every worker exited 0
COORDINATOR_LINGER_S = 1.0  # ... of which it may take this long before we send SIGTERM
COORDINATOR_EXIT_POLL_S = 0.1  # ... unless no rank registered after this long (no init)
COORDINATOR_PING_S = 0.5  # the launcher's question to the coordinator: did anyone register?
OUTPUT_DRAIN_S = 2.0
# Tests only: a stand-in for ``python -m ddl.server.daemon`` (shlex-split), used while the
# daemon does not exist yet. The launcher appends the same arguments.
TEST_COORDINATOR_CMD = "DDL_TEST_COORDINATOR_CMD"
# Tests only: simulate several nodes on this host, "n0,n1,...": ranks per node.
TEST_LOCAL_NODES = "DDL_TEST_LOCAL_NODES"
_UNIX_PATH_MAX = 100


@dataclass
class JobResult:
    """How a job ended. ``exit_code`` is shell-style (signal ``s`` -> ``128 + s``)."""

    exit_code: int
    returncodes: Dict[int, int] = field(default_factory=dict)  # rank (or -1) -> Popen code
    failed_rank: Optional[int] = None  # rank of the first failure; -1: the coordinator
    summary: str = ""  # one line, without the "ddlrun: " prefix; "" on success
    warnings: List[str] = field(default_factory=list)


def _parse_nodes(text: str, size: int) -> List[int]:
    try:
        nodes = [int(part) for part in text.split(",")]
    except ValueError:
        nodes = []
    if not nodes or min(nodes) < 1 or sum(nodes) != size:
        raise LaunchError(f"{TEST_LOCAL_NODES}={text!r}: expected ranks per node, each "
                          f">= 1, adding up to the job size {size}")
    return nodes


class Job(MultiHostLaunch, Attribution):
    """A coordinator plus one worker per entry of ``worker_argvs`` on this host."""

    def __init__(self, worker_argvs: Sequence[Sequence[str]], *, start_timeout: float,
                 env: Optional[Mapping[str, str]] = None,
                 extra_env: Optional[Mapping[str, str]] = None,
                 pass_fds: Sequence[Sequence[int]] = (), output_dir: str = "",
                 verbose: bool = False, stdout: Optional[IO[str]] = None,
                 stderr: Optional[IO[str]] = None, rank0_stdin: bool = False,
                 log_prefix: str = "ddlrun", workers_self_pdeathsig: bool = False,
                 hosts: Optional[Sequence[Tuple[str, int]]] = None,
                 remote: Optional[RemoteSettings] = None, timestamps: bool = False):
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
        # parent-death signal themselves (see ddl.core.pdeathsig).
        self._workers_self_pdeathsig = workers_self_pdeathsig
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._procs: Dict[int, subprocess.Popen] = {}
        self._returncodes: Dict[int, int] = {}
        self._forwarder = Forwarder(timestamps)
        self._stop_signal: Optional[int] = None
        # Set when every worker succeeded and we TERM an idle coordinator: its "aborting"
        # lines would only confuse (shown with verbose).
        self._mute_coordinator = threading.Event()
        self._tmpdir = ""
        self._report_dir = ""
        self.job_id = _auth.new_job_id()
        self.coordinator_addr = ""
        self._secret = ""
        nodes_text = self._base_env.get(TEST_LOCAL_NODES, "")
        self._nodes = _parse_nodes(nodes_text, self.size) if nodes_text else [self.size]
        # several hosts (ddlrun -H): ranks per host, and which hosts are reached over ssh
        self._hosts = [h for h, n in hosts or () if n > 0]
        self._remote = remote or RemoteSettings()
        self._is_remote = [False] * len(self._nodes)
        if any(not is_local(h) for h in self._hosts):
            self._nodes = [n for _, n in hosts if n > 0]
            self._is_remote = [not is_local(h) for h in self._hosts]
            if sum(self._nodes) != self.size:
                raise ValueError("the hosts' ranks must add up to the number of workers")
        self._stdins: List[IO[bytes]] = []  # the remote agents' (closing one stops it)
        self._remote_indices: set = set()
        self._addresses: Dict[str, str] = {}  # the probe's choice per host
        self._stderr_threads: Dict[int, threading.Thread] = {}
        self._coordinator_hosts: Dict[int, str] = {}  # index -> host, for messages

    # -- public -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the coordinator and the workers; raise :class:`LaunchError` on failure."""
        out = self._stdout or sys.stdout
        err = self._stderr or sys.stderr
        secret = self._secret = _auth.new_secret()
        self._tmpdir = tempfile.mkdtemp(prefix="ddl-")  # mode 0700
        if len(self._tmpdir) > _UNIX_PATH_MAX - len("/coord.sock"):
            os.rmdir(self._tmpdir)
            self._tmpdir = tempfile.mkdtemp(prefix="ddl-", dir="/tmp")
        sock = os.path.join(self._tmpdir, "coord.sock")
        self.coordinator_addr = "unix:" + sock

        common = {k: v for k, v in self._base_env.items() if not self._is_internal(k)}
        common.update(self._extra_env)
        self._report_dir = os.path.join(self._tmpdir, "reports")
        os.mkdir(self._report_dir, 0o700)
        common.update({"DDL_JOB_ID": self.job_id, "DDL_JOB_SECRET": secret,
                       "DDL_REPORT_DIR": self._report_dir})
        common.setdefault("PYTHONUNBUFFERED", "1")

        if any(self._is_remote):
            self._start_hosts(common, out, err)
            return
        coord_argv = self._coordinator_argv(common) + [
            "--address", self.coordinator_addr, "--size", str(self.size),
            "--start-timeout", repr(self._start_timeout), "--job-dir", self._tmpdir]
        addresses = [self.coordinator_addr]
        hostnames = [common.get("DDL_HOSTNAME", "")] * len(self._nodes)
        if len(self._nodes) > 1:
            base = common.get("DDL_HOSTNAME") or socket.gethostname()
            hostnames = [f"{base}-node{i}" for i in range(len(self._nodes))]
            addr_file = os.path.join(self._tmpdir, "coord.addr")
            bind = common.get("DDL_BIND_ADDRESS") or "127.0.0.1"
            coord_argv += ["--peer-address", f"{bind}:0", "--address-file", addr_file,
                           "--hostname", hostnames[0]]
        self._start_coordinator(0, coord_argv, dict(common, DDL_SIZE=str(self.size)), err)
        self._wait_for_file(sock, COORDINATOR)
        if len(self._nodes) > 1:
            self._wait_for_file(addr_file, COORDINATOR)
            with open(addr_file) as f:
                peer_address = f.read().split()[1]
            for node in range(1, len(self._nodes)):
                path = os.path.join(self._tmpdir, f"coord{node}.sock")
                addresses.append("unix:" + path)
                argv = [sys.executable, "-m", "ddl.server.daemon", "--address", addresses[-1],
                        "--size", str(self.size), "--start-timeout",
                        repr(self._start_timeout), "--leader", peer_address, "--local-size",
                        str(self._nodes[node]), "--hostname", hostnames[node],
                        "--job-dir", self._tmpdir]
                self._start_coordinator(node, argv, dict(common, DDL_SIZE=str(self.size)),
                                        err)
                self._wait_for_file(path, coordinator_index(node))

        rank = 0
        for node, count in enumerate(self._nodes):
            for local_rank in range(count):
                self._start_worker(rank, local_rank, count, addresses[node], hostnames[node],
                                   common, out, err)
                rank += 1

    def _start_coordinator(self, node: int, argv: List[str], env: Dict[str, str],
                           err: IO[str]) -> None:
        index = coordinator_index(node)
        self._coordinator_hosts[index] = (env.get("DDL_HOSTNAME") or socket.gethostname()
                                          if "--hostname" not in argv else
                                          argv[argv.index("--hostname") + 1])
        name = "[coordinator]" if node == 0 else f"[coordinator {node}]"
        self._log(f"starting {who(index)}: {self._show(env, argv)}")
        # Its stdout holds only its bound addresses: shown with --verbose.
        self._launch(index, argv, env, (), subprocess.DEVNULL, False, {
            "stdout": (f"{name}<stdout>:", err if self._verbose else None, None),
            "stderr": (f"{name}<stderr>:", err, None, self._mute_coordinator)})
        if "--address" in argv:  # a coordinator on this host: its workers may check on it
            _report.write_pid(self._report_dir, argv[argv.index("--address") + 1],
                                          self._procs[index].pid)

    def _start_worker(self, rank: int, local_rank: int, local_size: int, address: str,
                      hostname: str, common: Mapping[str, str], out: IO[str],
                      err: IO[str]) -> None:
        argv = self._argvs[rank]
        env = dict(common)
        env.update(_config.to_env({
            "rank": rank, "size": self.size, "local_rank": local_rank,
            "local_size": local_size, "coordinator_addr": address}))
        env.update(_config.horovod_identity(rank=rank, size=self.size, local_rank=local_rank,
                                            local_size=local_size))
        if hostname:
            env["DDL_HOSTNAME"] = hostname
        files = self._open_rank_files(rank)
        self._log(f"starting rank {rank}: {self._show(env, argv)}")
        stdin = None if (rank == 0 and self._rank0_stdin) else subprocess.DEVNULL
        self._launch(rank, argv, env, self._pass_fds[rank], stdin, False, {
            "stdout": (f"[{rank}]<stdout>:", out, files[0]),
            "stderr": (f"[{rank}]<stderr>:", err, files[1])})
        _report.write_pid(self._report_dir, rank, self._procs[rank].pid)

    def wait(self) -> JobResult:
        """Watch the job until it ends; tear it down on the first failure."""
        try:
            return self._watch()
        except BaseException:
            self._teardown()
            raise

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask :meth:`wait` to stop the job (safe to call from a signal handler: it takes
        no lock, which the interrupted thread may hold; the waits poll the flag)."""
        self._stop_signal = signum

    def close(self) -> None:
        """Kill every process group that is left, drain output, remove the temp dir."""
        for stdin in self._stdins:  # a remote agent stops its process when this closes
            try:
                stdin.close()
            except OSError:
                pass
        self._stdins = []
        try:
            if any(i not in self._returncodes for i in self._procs):
                self._teardown()
            for proc in self._procs.values():
                signal_group(proc, signal.SIGKILL)  # grandchildren left in the groups
            self._forwarder.join(OUTPUT_DRAIN_S)
        finally:
            from ddl.dataplane.transports._shm_segment import cleanup_job_segments
            cleanup_job_segments(self.job_id)  # what a crashed rank may have left
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
            own = (self._workers_self_pdeathsig if index >= 0
                   else argv[:3] == [sys.executable, "-m", "ddl.server.daemon"])
            # a coordinator runs in the job's directory: ``-m`` puts the working directory
            # first on its path, where a checkout's ddl/ (without server/, which only the
            # installed package maps in) would hide the installed ddl
            if index < 0:
                env = absolute_pythonpath(env)
            proc = spawn(argv, env, pass_fds=pass_fds, stdin=stdin, merge_stderr=merge_stderr,
                         self_pdeathsig=own, cwd=self._tmpdir if index < 0 else None)
        except OSError as exc:
            raise LaunchError(f"cannot start {who(index)} ({shlex.join(argv)}): "
                              f"{exc.strerror or exc}") from None
        self._procs[index] = proc
        for attr, (prefix, dest, raw, *rest) in streams.items():
            thread = self._forwarder.add(getattr(proc, attr), prefix, dest, raw, *rest)
            if attr == "stderr":
                self._stderr_threads[index] = thread
        threading.Thread(target=self._reap, args=(index, proc), daemon=True,
                         name=f"ddlrun-wait {who(index)}").start()

    def _reap(self, index: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if index in self._remote_indices and index in self._stderr_threads:
            # a remote rank's report comes on its stderr, just before its exit
            self._stderr_threads[index].join(OUTPUT_DRAIN_S)
        if index >= 0 and code != 0:
            _report.write_exit(self._report_dir, index, describe_exit(code))
        self._events.put(("exit", index, code))

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

    def _wait_for_file(self, path: str, index: int) -> None:
        """Wait for the coordinator ``index`` to create ``path`` (its socket or address
        file); LaunchError if it exits, or on a stop, or after the start timeout."""
        deadline = time.monotonic() + self._start_timeout
        while not os.path.exists(path):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = "socket" if path.endswith(".sock") else "address file"
                raise LaunchError(
                    f"{who(index)} (pid {self._procs[index].pid}) did not create its "
                    f"{what} {path} within {self._start_timeout:g} s (--start-timeout)")
            self._check_start_events(index, min(0.02, remaining))

    def _check_start_events(self, index: int, timeout: float) -> None:
        """While ``index`` starts: return if nothing happened within ``timeout``; else
        LaunchError for a stop or for a process that exited before it was ready."""
        stop = self._stop_signal
        if stop is not None:
            raise LaunchError(f"interrupted by {signal.Signals(stop).name} while "
                              f"{who(index)} was starting")
        try:
            kind, which, value = self._events.get(timeout=timeout)
        except queue.Empty:
            return
        self._returncodes[which] = value
        raise LaunchError(f"{who(which)} (pid {self._procs[which].pid}) "
                          f"{describe_exit(value)} before it was ready")

    # -- watching -------------------------------------------------------------------------
    def _watch(self) -> JobResult:
        running = set(range(self.size)) - set(self._returncodes)
        while running:
            if self._stop_signal is not None:
                return self._fail_by_signal(self._stop_signal)
            try:
                kind, index, value = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._returncodes[index] = value
            running.discard(index)
            if value != 0 and index < 0 and running:
                return self._fail(*self._root_cause(running, index))
            if value != 0 and index >= 0:
                return self._fail(index, value)
        return self._finish_coordinators()

    def _root_cause(self, running: set, coordinator: int) -> Tuple[int, int]:
        """After a coordinator failed: the first worker that fails on its own within
        a short grace period (a coordinator usually fails *because* a worker was lost,
        and the workers then raise and exit), else that coordinator itself."""
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
            if value != 0 and index >= 0:
                return index, value  # _fail follows its report to the origin
        return coordinator, self._returncodes[coordinator]

    def _fail(self, index: int, returncode: int) -> JobResult:
        # The survivors raise the error that names the cause and usually exit on their
        # own: give them a moment before SIGTERM.
        self._await([i for i in self._procs if i >= 0], FAILURE_GRACE_S, stop_early=True,
                    frozen_done=True)
        first, how = self._origin(index)
        if first == index >= 0:
            first, how = self._alike(index, how)
        # an origin still running (it left the job but not its process) ends by this
        # teardown's signal: exit with the code of the rank that failed, not that signal
        running = first not in self._returncodes
        self._teardown()
        code = (returncode if first == index or running
                else self._returncodes.get(first, returncode))
        if exit_code(code) == 0:  # the origin left cleanly; the job still failed
            code = returncode
        return JobResult(exit_code(code), dict(self._returncodes), first,
                         f"{self._name(first)} {how}; the job was stopped")

    def _fail_by_signal(self, signum: int) -> JobResult:
        self._teardown()
        return JobResult(128 + signum, dict(self._returncodes), None,
                         f"received {signal.Signals(signum).name}; the job was stopped")

    def _finish_coordinators(self) -> JobResult:
        result = JobResult(0, {})
        coords = {i for i in self._procs if i < 0}
        self._await(coords, COORDINATOR_EXIT_POLL_S)
        if any(i not in self._returncodes for i in coords):
            if self._anyone_registered():
                self._await(coords, COORDINATOR_LINGER_S - COORDINATOR_EXIT_POLL_S)
            else:
                self._log("no rank called ddl.init(): stopping the coordinator now")
        left = {i for i in coords if i not in self._returncodes}
        if left:
            # Every worker is gone, so there is nothing left to coordinate.
            if not self._verbose:
                self._mute_coordinator.set()
            for i in left:
                signal_group(self._procs[i], signal.SIGTERM)
            self._await(left, COORDINATOR_EXIT_S - COORDINATOR_LINGER_S)
            for i in sorted(left, reverse=True):
                if i in self._returncodes:
                    continue
                signal_group(self._procs[i], signal.SIGKILL)
                self._await({i}, TERM_GRACE_S)
                result.warnings.append(f"{who(i)} (pid {self._procs[i].pid}) did not exit "
                                       f"within {COORDINATOR_EXIT_S:g} s after every rank "
                                       f"finished; it was killed")
        for i in sorted(coords - left, reverse=True):
            code = self._returncodes[i]
            if code != 0 and self._any_report():
                # it failed the job on its own: a rank left it with calls in flight (each
                # rank may have exited 0 so) or failed and still exited 0; name the rank
                first, how = self._origin(i)
                return JobResult(exit_code(code), dict(self._returncodes), first,
                                 f"{self._name(first)} {how}; the job failed")
            if code != 0:
                result.warnings.append(f"{who(i)} (pid {self._procs[i].pid}) "
                                       f"{describe_exit(code)} after every rank finished")
        result.returncodes = dict(self._returncodes)
        return result

    def _any_report(self) -> bool:
        """Whether a worker recorded a fatal-error report (:mod:`ddl.core.report`)."""
        return bool(self._report_dir) and any(
            _report.read(self._report_dir, i) for i in self._procs if i >= 0)

    def _anyone_registered(self) -> bool:
        """Whether a rank registered with the leader coordinator (True when it cannot
        tell). Nobody did when the program never called ``ddl.init()`` (``ddlrun -np 2
        hostname``): its coordinator waits for ranks that will never come, so it is
        stopped at once instead of after the linger."""
        if not self.coordinator_addr.startswith("unix:"):
            return True
        import grpc

        from ddl.v1 import coordinator_pb2 as pb
        from ddl.v1 import coordinator_pb2_grpc as pb_grpc
        token = ((_auth.GRPC_METADATA_KEY, _auth.grpc_token(self._secret, self.job_id)),)
        deadline = time.monotonic() + COORDINATOR_LINGER_S   # asked again while it is busy
        with grpc.insecure_channel(self.coordinator_addr) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                try:
                    reply = stub.Ping(pb.PingRequest(), timeout=min(COORDINATOR_PING_S, left),
                                      metadata=token)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        return True   # gone (exiting), or not ours to ask
                    continue
                return reply.registered > 0

    def _await(self, indices, timeout: float, stop_early: bool = False,
               frozen_done: bool = False) -> None:
        """Collect exit events until every index in ``indices`` exited or ``timeout``
        (or, with ``stop_early``, :meth:`stop` was called). With ``frozen_done``, a
        stopped process (SIGSTOP) counts as done: it cannot exit until it is killed."""
        deadline = time.monotonic() + timeout
        while any(i not in self._returncodes and not (frozen_done and self._frozen(i))
                  for i in indices):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop_early and self._stop_signal is not None):
                return
            try:
                kind, index, value = self._events.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                continue
            if kind == "exit":
                self._returncodes[index] = value

    def _frozen(self, index: int) -> bool:
        """Process ``index`` is stopped (SIGSTOP, a debugger): it ignores SIGTERM."""
        proc = self._procs.get(index)
        return proc is not None and index not in self._returncodes and _report.is_stopped(
            proc.pid)

    def _teardown(self) -> None:
        """SIGTERM the workers, SIGKILL survivors after 5 s (a stopped one at once: it
        would not act on SIGTERM); then the same for the coordinators, which stay up
        until then so that the workers learn the cause."""
        for group in ([i for i in self._procs if i >= 0], [i for i in self._procs if i < 0]):
            for index in group:
                if index not in self._returncodes:
                    signal_group(self._procs[index],
                                 signal.SIGKILL if self._frozen(index) else signal.SIGTERM)
            self._await(group, TERM_GRACE_S)
            for index in group:
                if index not in self._returncodes:
                    signal_group(self._procs[index], signal.SIGKILL)
            self._await(group, TERM_GRACE_S)

    # -- logging --------------------------------------------------------------------------
    def _log(self, text: str) -> None:
        if self._verbose:
            write_line(self._stderr or sys.stderr, f"{self._log_prefix}: {text}")

    def _show(self, env: Mapping[str, str], argv: Sequence[str]) -> str:
        """The command with the DDL_* variables the launcher set, never the secret."""
        shown = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
                 if k.startswith("DDL_") and k != "DDL_JOB_SECRET"
                 and self._base_env.get(k) != v]
        return " ".join(shown + [shlex.join(argv)])
