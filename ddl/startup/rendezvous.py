"""Ranks of a one-node MPI or Slurm job meet without mpi4py (and torchrun's workers of
one node, :mod:`ddl.startup.torchrun`): through private files.

All local ranks start at once; the first to take the node's lock starts the job's
coordinator and writes its address, job id and secret to a file that only this user can
read (``$TMPDIR/ddl-rdv-<uid>/<job key>.json``, directory 0700, file 0600); the others
read it under the same lock. The job key comes from the launcher (``PMIX_NAMESPACE``,
``SLURM_JOB_ID.SLURM_STEP_ID``, ...) or, failing that, the launcher's per-node process
(every local rank's parent). The rank that started the coordinator removes both files at
shutdown, and holds a shared lock on the info file until then; the files of a job killed
before it could (the lock gone with it) are removed by the next job that meets on the
node. A job that spans nodes needs mpi4py (the files do not cross nodes).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import tempfile
import time
from typing import Optional

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.core.errors import BootstrapError, ConfigError, DDLTimeoutError
from ddl.startup import mpi as _mpi
from ddl.startup.coordinator import LocalCoordinator
from ddl.startup.start import Start


def _directory() -> str:
    path = os.path.join(tempfile.gettempdir(), f"ddl-rdv-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise BootstrapError(f"ddl.init: {path} must be a directory of this user with mode "
                             f"0700 (it holds the job's secret); remove it and retry")
    return path


def _lock(fd: int, deadline: float, timeout: float) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            raise DDLTimeoutError(f"ddl.init: the node's rendezvous lock was held for more "
                                  f"than {timeout:g} s (DDL_START_TIMEOUT)", op="init",
                                  timeout=timeout)
        time.sleep(0.005)


def _alive(info: dict) -> bool:
    """Whether ``info`` describes a coordinator that still runs."""
    try:
        os.kill(int(info["pid"]), 0)
    except (OSError, KeyError, ValueError):
        return False
    return os.path.exists(str(info.get("address", ""))[len("unix:"):])


def rendezvous(cfg: _config.Config, launcher: _mpi.LauncherEnv) -> Start:
    """Meet this node's other ranks (see the module doc)."""
    if launcher.local_size != launcher.size:
        raise ConfigError(
            f"ddl.init() under {launcher.launcher} with {launcher.size} ranks on more than "
            f"one node needs mpi4py to exchange the job's addresses (with MPI's COMM_WORLD "
            f"holding every rank: under srun, --mpi=pmix): pip install mpi4py, or set "
            f"DDL_RENDEZVOUS_ADDR=<host of rank 0>:<a free port> and the same DDL_JOB_SECRET "
            f"(hex) on every node, or start the job with ddlrun",
            variable="mpi4py", value="missing")
    deadline = time.monotonic() + cfg.start_timeout
    hostname = cfg.hostname or socket.gethostname()
    mine: Optional[LocalCoordinator] = None
    held: Optional[int] = None   # the info file, locked shared while our coordinator runs
    fd, info_path, lock_path = _open_lock(launcher.job_key)
    try:
        _lock(fd, deadline, cfg.start_timeout)
        _sweep(info_path)
        info = _read(info_path)
        if info is None or not _alive(info):
            job_id, secret = _auth.new_job_id(), _auth.new_secret()
            mine = LocalCoordinator(job_id, secret, launcher.size, hostname,
                                    cfg.start_timeout)
            address = mine.wait_ready(deadline)[0]
            info = {"job_id": job_id, "secret": secret, "address": address,
                    "pid": mine.proc.pid, "size": launcher.size}
            held = _write(info_path, info)
        elif info.get("size") != launcher.size:
            raise BootstrapError(f"ddl.init: this node's job {launcher.job_key} has "
                                 f"{info.get('size')} ranks but {launcher.launcher} says "
                                 f"{launcher.size}")
    except BaseException:
        if mine is not None:
            mine.close(timeout=0)
            _remove(info_path, lock_path)
        if held is not None:
            os.close(held)
        raise
    finally:
        os.close(fd)  # releases the lock
    values = dict(rank=launcher.rank, size=launcher.size, coordinator_addr=info["address"],
                  job_id=info["job_id"], job_secret=info["secret"], hostname=hostname)

    def cleanup() -> None:   # the rank that started the coordinator, at shutdown
        _remove(info_path, lock_path)
        os.close(held)
    return Start(cfg.replace(**values), coordinator=mine,
                 mpi=_mpi.MpiState(launcher.launcher, None) if launcher.mpi else None,
                 cleanup=cleanup if mine is not None else None)


def _sweep(mine: str) -> None:
    """Remove the files of this node's jobs whose coordinator's rank is gone (killed
    before it could remove them: SIGKILL, or torchrun stopping the workers it restarts).
    That rank holds a shared lock on its info file while its job runs, which the kernel
    drops when it dies, in any PID namespace; a file we can lock exclusively is stale,
    and stays locked by us while we remove it."""
    directory = os.path.dirname(mine)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".json") or path == mine:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue   # held: its job runs
            for stale in (path, path[:-len(".json")] + ".lock"):
                try:
                    os.unlink(stale)
                except OSError:
                    pass
        finally:
            os.close(fd)


def _open_lock(job_key: str):
    """(fd, info path, lock path); the directory is made again if another job's cleanup
    removed it in between."""
    for _ in range(5):
        base = os.path.join(_directory(), job_key)
        try:
            return os.open(base + ".lock", os.O_RDWR | os.O_CREAT, 0o600), base + ".json", \
                base + ".lock"
        except FileNotFoundError:
            continue
    raise BootstrapError(f"ddl.init: cannot create the rendezvous lock {base}.lock")


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, info: dict) -> int:
    """Write ``info`` to ``path`` whole (a new file put in place), already locked shared
    when it appears there: returns that descriptor, to keep while the job runs."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # a new file of ours: never waits
        data = json.dumps(info).encode()
        while data:
            data = data[os.write(fd, data):]
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(*paths: str) -> None:
    """Remove the job's files, and the directory once no job uses it."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
    try:
        os.rmdir(os.path.dirname(paths[0]))
    except OSError:  # another job's files are there
        pass
