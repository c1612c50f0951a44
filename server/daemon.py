"""``ddl-coordinator``: the coordinator daemon a launcher starts on each node.

Usage::

    DDL_JOB_ID=... DDL_JOB_SECRET=... \\
    python -m ddl.server.daemon --address unix:/run/ddl/job/coord.sock --size 4

The job id and secret come from the environment only, never from argv. Flags default to
the ``DDL_*`` configuration (:func:`ddl._config.load`). The bound address is printed on
stdout as one line (useful with ``127.0.0.1:0``); logs go to stderr with the prefix
``ddl-coordinator:``.

Exit status: 0 when every worker said goodbye; 1 when a worker was lost, the job was
aborted (stall), the rendezvous timed out, or on SIGTERM/SIGINT (after an Abort of kind
SHUTDOWN to every worker); 2 on bad configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import sys
import threading
from typing import List, Optional

from ddl import _config
from ddl._pdeathsig import die_with_launcher
from ddl.v1 import coordinator_pb2 as pb

from .coordinator import CoordinatorServer

log = logging.getLogger("ddl.server")


def _parser(cfg: _config.Config) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddl-coordinator",
                                description="ddl coordinator daemon (leader of one job)")
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
    die_with_launcher(cfg.launcher_pid)
    args = _parser(cfg).parse_args(argv)
    if not cfg.job_id or not cfg.job_secret:
        log.error("DDL_JOB_ID and DDL_JOB_SECRET must be set in the environment")
        return _exit(2, argv)
    log.setLevel(logging.INFO if cfg.verbose else logging.WARNING)
    problem = _check_socket_dir(args.address)
    if problem:
        log.error("%s", problem)
        return _exit(2, argv)
    os.umask(0o077)  # the socket file is born private; start() also chmods it 0600
    try:
        srv = CoordinatorServer(cfg.job_id, cfg.job_secret, args.size, args.address,
                                fusion_threshold=args.fusion_threshold,
                                stall_check_time=args.stall_check_time,
                                stall_shutdown_time=args.stall_shutdown_time,
                                start_timeout=args.start_timeout)
        bound = srv.start()
    except Exception as exc:
        log.error("cannot start: %s", exc)
        return _exit(2, argv)
    print(bound, flush=True)

    signalled = threading.Event()
    names = {}

    def on_signal(signum: int, frame: object) -> None:
        names["sig"] = signal.Signals(signum).name
        signalled.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not srv.wait(0.05) and not signalled.is_set():
        pass
    if signalled.is_set() and not srv.wait(0):
        log.error("received %s; aborting the job", names.get("sig", "a signal"))
        srv.abort_job(pb.SHUTDOWN,
                      f"ShutdownError: the coordinator received {names.get('sig')}; "
                      f"the job is shutting down")
        srv.stop(grace=0.5)
        return _exit(1, argv)
    srv.stop(grace=0.5)
    status = 1 if srv.failed else 0
    if status:
        log.error("job failed")
    else:
        log.info("every worker said goodbye; exiting")
    return _exit(status, argv)


def _exit(status: int, argv: Optional[List[str]]) -> int:
    if argv is None:  # console entry point
        sys.exit(status)
    return status


if __name__ == "__main__":
    main()
