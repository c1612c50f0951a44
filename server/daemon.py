"""``ddl-coordinator``: the coordinator daemon a launcher starts on each node.

Usage (the leader, on node 0; ``--peer-address`` also listens for the other nodes'
coordinators)::

    DDL_JOB_ID=... DDL_JOB_SECRET=... \\
    python -m ddl.server.daemon --address unix:/run/ddl/job/coord.sock --size 4 \\
        --peer-address 10.0.0.1:0

and on every other node (a relay to the leader for its ``--local-size`` workers)::

    python -m ddl.server.daemon --address unix:/run/ddl/job/coord.sock --size 4 \\
        --leader 10.0.0.1:45123 --local-size 2

The job id and secret come from the environment only, never from argv. Flags default to
the ``DDL_*`` configuration (:func:`ddl.core.config.load`). The bound addresses are printed
on stdout, one per line (the worker address, then the peer address if any), and written
to ``--address-file`` when given (atomically, so the file appears complete); logs go to
stderr with the prefix ``ddl-coordinator:``.

Exit status: 0 when every worker said goodbye; 1 when a worker or coordinator was lost,
the job was aborted (stall), the rendezvous timed out, or on SIGTERM/SIGINT (after an
Abort of kind SHUTDOWN to every worker); 2 on bad configuration or when the leader
cannot be reached.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import threading
from typing import List, Optional

from ddl.core import config as _config
from ddl.core import report as _report
from ddl.core.pdeathsig import die_with_launcher
from ddl.v1 import coordinator_pb2 as pb

from .coordinator import CoordinatorServer
from .relay import RelayServer

log = logging.getLogger("ddl.server")


def _parser(cfg: _config.Config) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddl-coordinator",
                                description="ddl coordinator daemon (one per node of a job)")
    p.add_argument("--address", required=True,
                   help="unix:/abs/path.sock or host:port (port 0 picks a free port)")
    p.add_argument("--size", type=int, required=True, help="number of ranks in the job")
    p.add_argument("--fusion-threshold", type=int, default=cfg.fusion_threshold,
                   help="largest fused allreduce, bytes; 0 disables fusion")
    p.add_argument("--stall-check-time", type=float, default=cfg.stall_check_time,
                   help="seconds before a stall warning; 0 disables")
    p.add_argument("--stall-shutdown-time", type=float, default=cfg.stall_shutdown_time,
                   help="seconds before a stall aborts the job; 0 disables")
    p.add_argument("--start-timeout", type=float, default=cfg.start_timeout,
                   help="seconds for every rank to register")
    p.add_argument("--cache-capacity", type=int, default=cfg.cache_capacity,
                   help="response-cache slots the leader assigns; 0 disables the cache")
    p.add_argument("--heartbeat-interval", type=float, default=cfg.heartbeat_interval,
                   help="seconds of silence before a stream gets a heartbeat")
    p.add_argument("--liveness-timeout", type=float, default=cfg.liveness_timeout,
                   help="seconds of silence after which a worker or coordinator is lost; "
                        "0 disables")
    p.add_argument("--keepalive-interval", type=float, default=cfg.keepalive_interval,
                   help="seconds between HTTP/2 keepalive pings on every connection")
    p.add_argument("--keepalive-timeout", type=float, default=cfg.keepalive_timeout,
                   help="seconds a ping may go unanswered before the peer is lost (frozen "
                        "or unreachable); 0 disables")
    p.add_argument("--peer-address", default="",
                   help="leader only: host:port where the other nodes' coordinators connect")
    p.add_argument("--leader", default="",
                   help="host:port of the leader's peer address; makes this coordinator a "
                        "relay for its node")
    p.add_argument("--local-size", type=int, default=0,
                   help="with --leader: the number of workers on this node")
    p.add_argument("--hostname", default=cfg.hostname or socket.gethostname(),
                   help="this node's name in error messages")
    p.add_argument("--address-file", default="",
                   help="also write the bound addresses to this file")
    p.add_argument("--job-dir", default="",
                   help="the launcher's directory for this job (sockets, reports): removed "
                        "at exit if the launcher is gone")
    p.add_argument("--own-job-dir", action="store_true",
                   help="the --job-dir is this coordinator's alone (a worker started it): "
                        "removed at exit in any case")
    return p


def _check_socket_dir(address: str) -> Optional[str]:
    """Create the socket's directory 0700 if missing; refuse one others can enter."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:"):]
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
    mode = stat.S_IMODE(os.stat(directory).st_mode)
    if mode & 0o077:
        return (f"socket directory {directory} has mode {mode:04o}; it must be 0700 so only "
                f"this user can reach the coordinator")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Run the daemon until the job ends; returns (and exits with) its status."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ddl-coordinator: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    try:
        cfg = _config.load()
    except Exception as exc:  # ConfigError names the variable
        log.error("%s", exc)
        return _exit(2, argv)
    args = _parser(cfg).parse_args(argv)

    def on_early_signal(signum: int, frame: object) -> None:
        # while starting (a relay may wait for its leader): leave nothing behind, now
        _clean_up(args, cfg.launcher_pid)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_early_signal)
    signal.signal(signal.SIGINT, on_early_signal)
    # SIGTERM: a launcher killed outright leaves its job directory to us
    die_with_launcher(cfg.launcher_pid, signal.SIGTERM)
    if not cfg.job_id or not cfg.job_secret:
        log.error("DDL_JOB_ID and DDL_JOB_SECRET must be set in the environment")
        return _exit(2, argv)
    log.setLevel(_config.log_level(cfg))
    problem = _check_socket_dir(args.address)
    if problem:
        log.error("%s", problem)
        return _exit(2, argv)
    os.umask(0o077)  # the socket file is born private; start() also chmods it 0600
    try:
        srv = _make_server(cfg, args)
        bound = srv.start()
    except Exception as exc:
        log.error("cannot start: %s", exc)
        return _exit(2, argv)
    lines = "".join(f"{a}\n" for a in [bound] + srv.extra_bound)
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(lines)
        os.replace(tmp, args.address_file)
    sys.stdout.write(lines)
    sys.stdout.flush()

    received: List[str] = []  # signal names, appended by the handler

    def on_signal(signum: int, frame: object) -> None:
        # no lock may be taken here: the handler runs between two bytecodes of the main
        # thread, which may hold the very lock (a second signal arriving while a first
        # handler held an Event's lock deadlocked this process); the loop below polls
        received.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    while not srv.wait(0.05) and not received:
        pass
    names = {"sig": received[0]} if received else {}
    if received:
        # whatever the shutdown below waits on, this process is gone within seconds
        timer = threading.Timer(_SIGNAL_EXIT_S, _die, args=(args, cfg.launcher_pid))
        timer.daemon = True
        timer.start()
    if received and not srv.wait(0):
        # under a launcher, a signal is the launcher stopping the job, and the launcher
        # says why; said only with --verbose then, so that it does not read like a crash
        (log.info if cfg.launcher_pid else log.error)(
            "received %s; stopping the job", names.get("sig", "a signal"))
        if not _lost_its_starter(srv, args.hostname, cfg.launcher_pid):
            cause = f"it received {names.get('sig')}"
            srv.abort_job(pb.SHUTDOWN,
                          f"the coordinator of host {args.hostname} (pid {os.getpid()}) "
                          f"received {names.get('sig')}; the job is shutting down", cause,
                          args.hostname)
        srv.stop(grace=0.5)
        _clean_up(args, cfg.launcher_pid)
        return _exit(1, argv)
    srv.stop(grace=0.5)
    _clean_up(args, cfg.launcher_pid)
    status = 1 if srv.failed else 0
    if status:
        why = srv.failure()
        log.error("job failed%s", f": {why}" if why else "")
    else:
        log.info("every worker said goodbye; exiting")
    return _exit(status, argv)


_SIGNAL_EXIT_S = 3.0  # after SIGTERM/SIGINT, exit by then at the latest


def _lost_its_starter(srv, hostname: str, starter: int) -> bool:
    """A coordinator that a rank started (under torchrun, MPI, pods, an elastic world)
    gets its parent-death signal when that rank's process dies: the job then fails as
    when the leader sees the rank's stream close, with PEER_LOST naming the rank, not
    with a shutdown of this coordinator. Whichever of the two comes first is what every
    rank is told. True if so."""
    if starter <= 0 or not hasattr(srv, "lose_rank_of") or not (
            os.getppid() != starter or _report.is_going(starter)):
        return False
    return srv.lose_rank_of(hostname, starter, "its process ended (seen by the coordinator it "
                                               "had started, which stops with it)")


def _die(args: argparse.Namespace, launcher_pid: int) -> None:
    log.error("shutdown took longer than %g s; exiting now", _SIGNAL_EXIT_S)
    _clean_up(args, launcher_pid)
    os._exit(1)


def _clean_up(args: argparse.Namespace, launcher_pid: int) -> None:
    """Remove this coordinator's socket file, and the job directory when it is this
    coordinator's own or the launcher is gone (killed: it could not remove it itself)."""
    if args.address.startswith("unix:"):
        try:
            os.unlink(args.address[len("unix:"):])
        except OSError:
            pass
    # the launcher is gone: this process's parent is another one, or still the
    # launcher's, as it dies (our parent-death signal comes as its first thread exits)
    if args.job_dir and (args.own_job_dir or launcher_pid > 0 and (
            os.getppid() != launcher_pid or _report.is_going(launcher_pid))):
        shutil.rmtree(args.job_dir, ignore_errors=True)


def _make_server(cfg: _config.Config, args: argparse.Namespace):
    """The leader, or with ``--leader`` a relay; ValueError on a bad combination."""
    if args.leader:
        if args.peer_address:
            raise ValueError("--peer-address is for the leader; a coordinator started with "
                             "--leader cannot take it")
        if args.local_size < 1:
            raise ValueError("--leader needs --local-size N (N >= 1 workers on this node)")
        return RelayServer(cfg.job_id, cfg.job_secret, args.size, args.address, args.leader,
                           args.local_size, args.hostname, start_timeout=args.start_timeout,
                           heartbeat_interval=args.heartbeat_interval,
                           liveness_timeout=args.liveness_timeout,
                           report_dir=cfg.report_dir,
                           keepalive_interval=args.keepalive_interval,
                           keepalive_timeout=args.keepalive_timeout)
    srv = CoordinatorServer(cfg.job_id, cfg.job_secret, args.size, args.address,
                            fusion_threshold=args.fusion_threshold,
                            stall_check_time=args.stall_check_time,
                            stall_shutdown_time=args.stall_shutdown_time,
                            start_timeout=args.start_timeout,
                            heartbeat_interval=args.heartbeat_interval,
                            liveness_timeout=args.liveness_timeout,
                            report_dir=cfg.report_dir,
                            cache_capacity=args.cache_capacity,
                            keepalive_interval=args.keepalive_interval,
                            keepalive_timeout=args.keepalive_timeout,
                            tuner=_tuner(cfg, args))
    if args.peer_address:
        srv.listen_also(args.peer_address)
    return srv


def _tuner(cfg: _config.Config, args: argparse.Namespace):
    """The leader's autotuner with DDL_AUTOTUNE, else None (optuna loads only then).
    The job spans hosts when other nodes' coordinators connect (``--peer-address``)."""
    if not cfg.autotune:
        return None
    from .autotune import Tuner, knobs_for
    defaults = {k: getattr(cfg, k) for k in _config.TUNABLE}
    defaults["fusion_threshold"] = max(0, args.fusion_threshold)
    return Tuner(defaults, knobs_for(bool(args.peer_address), cfg.transport),
                 warmup_samples=cfg.autotune_warmup_samples,
                 steps_per_sample=cfg.autotune_steps_per_sample,
                 max_samples=cfg.autotune_max_samples, log_file=cfg.autotune_log_file)


def _exit(status: int, argv: Optional[List[str]]) -> int:
    if argv is None:  # console entry point
        sys.exit(status)
    return status


if __name__ == "__main__":
    main()
