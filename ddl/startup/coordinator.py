"""A coordinator daemon started by one of the job's own workers (MPI starts, no ddlrun).

Under ddlrun the launcher starts one coordinator per node. When MPI started the job,
one worker per node starts it instead: rank 0 of the communicator starts the leader,
the first rank on every other node a relay to it. The daemon dies with the worker that
started it (parent-death signal); that worker waits for it at shutdown, after every rank
of the node said goodbye, and removes its private socket directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Mapping, Optional

from ddl.core.child_env import absolute_pythonpath
from ddl.core.errors import DDLTimeoutError
from ddl.core.process_group import stop_group

_UNIX_PATH_MAX = 107
EXIT_WAIT_S = 10.0  # at shutdown: the daemon's time to see every goodbye and exit


class LocalCoordinator:
    """One ``ddl.server.daemon`` process owned by this worker."""

    def __init__(self, job_id: str, secret: str, size: int, hostname: str,
                 start_timeout: float, *, leader_peer_bind: str = "",
                 leader: str = "", local_size: int = 0,
                 environ: Optional[Mapping[str, str]] = None):
        self.dir = tempfile.mkdtemp(prefix="ddl-")  # mode 0700
        if len(self.dir) > _UNIX_PATH_MAX - len("/coord.sock"):
            os.rmdir(self.dir)
            self.dir = tempfile.mkdtemp(prefix="ddl-", dir="/tmp")
        self.address = "unix:" + os.path.join(self.dir, "coord.sock")
        self._addr_file = os.path.join(self.dir, "coord.addr")
        argv: List[str] = [sys.executable, "-m", "ddl.server.daemon", "--address",
                           self.address, "--size", str(size), "--start-timeout",
                           repr(start_timeout), "--hostname", hostname, "--job-dir",
                           self.dir, "--own-job-dir", "--address-file", self._addr_file]
        if leader_peer_bind:
            argv += ["--peer-address", leader_peer_bind]
        if leader:
            argv += ["--leader", leader, "--local-size", str(local_size)]
        base = os.environ if environ is None else environ
        env = {k: v for k, v in base.items()
               if not k.startswith(("DDL_RANK", "DDL_SIZE", "DDL_LOCAL_", "DDL_COORDINATOR"))}
        env.update(DDL_JOB_ID=job_id, DDL_JOB_SECRET=secret, DDL_SIZE=str(size),
                   DDL_LAUNCHER_PID=str(os.getpid()))
        # MPI's variables would make a daemon that imports mpi4py think it is a rank
        env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_"))}
        try:
            # in its own directory: ``-m`` puts the working directory first on its path,
            # where a checkout's ddl/ would hide the installed ddl (and its server)
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                argv, env=absolute_pythonpath(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                close_fds=True, start_new_session=True, cwd=self.dir)
        except OSError:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def wait_ready(self, deadline: float) -> List[str]:
        """The daemon's bound addresses (its socket, then a leader's peer address), once
        it wrote them; DDLTimeoutError by ``deadline``, RuntimeError if it exited."""
        while True:
            if os.path.exists(self._addr_file):
                with open(self._addr_file) as f:
                    return f.read().split()
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the coordinator daemon exited with code {code} before "
                                   f"it was ready (its stderr says why)")
            if time.monotonic() > deadline:
                raise DDLTimeoutError("the coordinator daemon was not ready in time",
                                      op="init")
            time.sleep(0.01)

    def close(self, timeout: float = EXIT_WAIT_S) -> None:
        """Wait (bounded) for the daemon to exit after the job's goodbyes, stop it if it
        does not, and remove its directory."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stop_group(proc, 5.0)
        shutil.rmtree(self.dir, ignore_errors=True)
