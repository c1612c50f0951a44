"""How ``ddl.init()`` finds its job: ddlrun, an mpi4py communicator, an MPI launcher,
torchrun, or nothing (one process).

In order:

1. ``ddl.init(comm=...)``: the communicator's ranks become one ddl job (ddl rank = rank
   in the communicator). A list of ``COMM_WORLD`` ranks makes that communicator first.
2. ddlrun or ``ddl.run`` set ``DDL_COORDINATOR_ADDR`` and the rank: used as they are.
3. ``DDL_RENDEZVOUS_ADDR`` with ``DDL_RANK``, ``DDL_SIZE`` and ``DDL_JOB_SECRET`` (pods,
   containers, any scheduler): the ranks meet at rank 0's address over authenticated TCP
   (:mod:`ddl.startup.tcp_rendezvous`) and bootstrap as over a communicator. Under
   torchrun, MPI or Slurm the launcher's rank and size stand in for unset ``DDL_RANK``
   and ``DDL_SIZE`` (a job over several nodes without mpi4py).
4. torchrun (:mod:`ddl.startup.torchrun`): its workers of one node meet through the
   node's files, as in 5; those of a job over several nodes meet at rank 0 over
   authenticated TCP as in 3, with ``DDL_JOB_SECRET`` set, learning rank 0's port from
   torchrun's store.
5. An MPI or Slurm launcher (:func:`ddl.startup.mpi.detect`) with more than one process:
   ``COMM_WORLD`` bootstraps the job when mpi4py is installed; without mpi4py, the ranks
   of a one-node job meet through a private file on the node
   (:mod:`ddl.startup.rendezvous`).
6. torch.distributed's ``RANK`` and ``WORLD_SIZE`` without torchrun: with more than one
   rank, a ConfigError asking for ``DDL_RENDEZVOUS_ADDR`` (3).
7. Otherwise a job of one process with an embedded coordinator.

Over a communicator: every rank first arrives at a non-blocking barrier (bounded by
``DDL_START_TIMEOUT``); rank 0 starts the leader coordinator and broadcasts the job id,
secret and addresses; the first rank on every other node starts a relay coordinator; an
allgather hands each rank its node's coordinator. Messages are JSON bytes (no pickle).
MPI is used for nothing else, so MPI and ddl collectives can be mixed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, List, Optional

import numpy as np

from ddl.core import auth as _auth
from ddl.core import config as _config
from ddl.core.errors import BootstrapError, ConfigError, DDLTimeoutError, NotEnoughRanksError
from ddl.startup import elastic_link as _elastic
from ddl.startup import mpi as _mpi
from ddl.startup import torchrun as _torchrun
from ddl.startup.coordinator import LocalCoordinator
from ddl.startup.rendezvous import rendezvous
from ddl.startup.start import Start


def resolve(cfg: _config.Config, comm: Any = None) -> Start:
    """The configuration this process starts with (see the module doc)."""
    if comm is not None:
        if cfg.coordinator_addr:
            raise ConfigError("ddl.init(comm=...) cannot be used in a job started by ddlrun; "
                              "start it with mpirun (or ddlrun --mpi)", variable="comm",
                              value=type(comm).__name__)
        comm, owned = _communicator(comm)
        try:
            return over_communicator(cfg, comm, "mpi4py communicator")
        finally:
            if owned:
                comm.Free()
    if cfg.coordinator_addr:
        return Start(cfg)
    if cfg.elastic_addr:
        return over_elastic(cfg)
    launcher = _torchrun.detect() or _mpi.detect() or (
        _torchrun.detect_env() if cfg.rank is None and cfg.size is None else None)
    if cfg.rendezvous_addr:
        return over_tcp(cfg, launcher)
    if launcher is None:
        return Start(cfg)
    state = _mpi.MpiState(launcher.launcher, None) if launcher.mpi else None
    if launcher.size == 1:
        return Start(cfg.replace(rank=0, size=1), mpi=state)
    if not launcher.mpi:   # torchrun, or torch.distributed's variables
        if _torchrun.meets_through_store(launcher, cfg.job_secret):
            return over_tcp(cfg, launcher, through_store=True)
        _torchrun.check_one_node(launcher)
        return rendezvous(cfg, launcher)
    if _mpi.mpi4py_available():
        MPI = _mpi.import_mpi()
        world = MPI.COMM_WORLD
        if world.Get_size() == launcher.size and world.Get_rank() == launcher.rank:
            return over_communicator(cfg, world, launcher.launcher)
        # e.g. srun without --mpi: MPI started as a singleton; fall through
    return rendezvous(cfg, launcher)


def _communicator(comm: Any):
    """(communicator, whether we made it) from a communicator or a list of world ranks."""
    if _mpi.is_communicator(comm):
        return comm, False
    if isinstance(comm, (list, tuple)):
        MPI = _mpi.import_mpi()
        world = MPI.COMM_WORLD
        ranks = list(comm)
        bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool)
               or not 0 <= r < world.Get_size()]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ConfigError(f"ddl.init(comm={ranks}): a list of distinct COMM_WORLD ranks "
                              f"in [0, {world.Get_size()}) was expected", variable="comm",
                              value=str(ranks))
        if world.Get_rank() not in ranks:
            raise ConfigError(f"ddl.init(comm={ranks}) was called on COMM_WORLD rank "
                              f"{world.Get_rank()}, which the list leaves out (ranks left "
                              f"out must not call init)", variable="comm", value=str(ranks))
        group = world.Get_group().Incl(ranks)
        try:
            return world.Create_group(group), True
        finally:
            group.Free()
    raise ConfigError(f"ddl.init(comm=...) takes an mpi4py communicator or a list of "
                      f"COMM_WORLD ranks, not {type(comm).__name__}", variable="comm",
                      value=type(comm).__name__)


# -- over a communicator ----------------------------------------------------------------------

def over_communicator(cfg: _config.Config, comm: Any, launcher: str) -> Start:
    """Bootstrap the job of ``comm``'s ranks (collective over ``comm``)."""
    MPI = _mpi.import_mpi()
    state = _mpi.MpiState(launcher, MPI.Query_thread(), comm.Get_group())
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + cfg.start_timeout
    _arrive(comm, deadline, cfg.start_timeout)
    comm = comm.Dup()  # our messages never match the user's
    try:
        if size == 1:
            return Start(cfg.replace(rank=0, size=1), mpi=state)
        return start_job(cfg, _MpiJson(comm), rank, size, deadline, state)
    finally:
        comm.Free()


def over_tcp(cfg: _config.Config, launcher: Optional[_mpi.LauncherEnv] = None,
             through_store: bool = False) -> Start:
    """Bootstrap from ``DDL_RENDEZVOUS_ADDR`` (see :mod:`ddl.startup.tcp_rendezvous`);
    under a launcher (torchrun, MPI or Slurm without mpi4py), its rank and size stand in
    for unset ``DDL_RANK`` and ``DDL_SIZE``. ``through_store``: torchrun over several
    nodes, whose ranks find rank 0's address through torchrun's store
    (:func:`ddl.startup.torchrun.rendezvous_through_store`)."""
    from ddl.startup.tcp_rendezvous import TcpComm, job_id_of
    state = None
    if launcher is not None:
        for var, mine, theirs in (("DDL_RANK", cfg.rank, launcher.rank),
                                  ("DDL_SIZE", cfg.size, launcher.size)):
            if mine is not None and mine != theirs:
                raise ConfigError(f"{var}={mine} but {launcher.launcher} says {theirs}: unset "
                                  f"{var} (the launcher's value is used)", variable=var,
                                  value=str(mine))
        cfg = cfg.replace(rank=launcher.rank, size=launcher.size)
        state = _mpi.MpiState(launcher.launcher, None) if launcher.mpi else None
    missing = [name for name, value in (("DDL_RANK", cfg.rank), ("DDL_SIZE", cfg.size),
                                        ("DDL_JOB_SECRET", cfg.job_secret)) if value in (None, "")]
    if missing:
        raise ConfigError(f"DDL_RENDEZVOUS_ADDR={cfg.rendezvous_addr} is set but "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                          f"every rank needs DDL_RANK, DDL_SIZE and the same DDL_JOB_SECRET "
                          f"(hex, e.g. from a Kubernetes Secret)", variable=missing[0],
                          value="")
    if cfg.rank >= cfg.size:
        raise ConfigError(f"DDL_RANK={cfg.rank} is not below DDL_SIZE={cfg.size}",
                          variable="DDL_RANK", value=str(cfg.rank))
    job_id = cfg.job_id or job_id_of(cfg.job_secret)
    cfg = cfg.replace(job_id=job_id)
    if cfg.size == 1:
        return Start(cfg, mpi=state)
    deadline = time.monotonic() + cfg.start_timeout
    announce = None
    if through_store:
        addr, announce = _torchrun.rendezvous_through_store(cfg.rank, deadline,
                                                            cfg.start_timeout)
        cfg = cfg.replace(rendezvous_addr=addr)
    comm = TcpComm(cfg.rank, cfg.size, cfg.rendezvous_addr, cfg.job_secret, job_id, deadline,
                   cfg.start_timeout, announce=announce)
    try:
        return start_job(cfg, comm, cfg.rank, cfg.size, deadline, state,
                         job=(job_id, cfg.job_secret))
    finally:
        comm.close()


def over_elastic(cfg: _config.Config) -> Start:
    """Join the next world of an elastic job (see :mod:`ddl.startup.elastic_link`): ask
    ddlrun for a place, then bootstrap that world through ddlrun as over a communicator
    (its new rank 0 starts the leader coordinator: the leader moves with rank 0)."""
    if cfg.elastic_worker is None or not cfg.job_secret or not cfg.job_id:
        raise ConfigError("DDL_ELASTIC_ADDR is set but DDL_ELASTIC_WORKER, DDL_JOB_ID or "
                          "DDL_JOB_SECRET is not; elastic workers are started by ddlrun "
                          "--min-np/--max-np", variable="DDL_ELASTIC_WORKER")
    worker, timeout = cfg.elastic_worker, cfg.start_timeout
    link = _elastic.link(cfg.elastic_addr, cfg.job_secret, cfg.job_id, worker, timeout)
    previous = _elastic.world["generation"] if _elastic.world else -1
    lost, reason = _elastic.take_failure()
    reply = link.request({"op": "join", "generation": previous, "lost": lost,
                          "reason": reason}, cfg.elastic_timeout + timeout,
                         f"ddl.init (elastic worker {worker})")
    if reply["op"] == "exit":
        import sys
        print(f"ddl: elastic worker {worker} leaves the job: {reply.get('message', '')}",
              file=sys.stderr, flush=True)
        raise SystemExit(0)
    if reply["op"] != "assign":
        raise NotEnoughRanksError(str(reply.get("message", reply)),
                                  min_np=int(reply.get("min_np", 0)),
                                  available=int(reply.get("available", 0)))
    _elastic.world = reply
    rank, size, generation = int(reply["rank"]), int(reply["size"]), int(reply["generation"])
    cfg = cfg.replace(rank=rank, size=size, job_id=reply["job_id"])
    if size == 1:
        return Start(cfg)
    deadline = time.monotonic() + timeout
    comm = _elastic.DriverComm(link, generation, rank, timeout)
    return start_job(cfg, comm, rank, size, deadline, None,
                     job=(reply["job_id"], cfg.job_secret), bind=str(reply.get("bind") or ""))


class _MpiJson:
    """An mpi4py communicator as the JSON communicator :func:`start_job` uses."""

    def __init__(self, comm: Any):
        self.comm = comm

    def bcast_json(self, obj: Any, root: int) -> Any:
        return bcast_json(self.comm, obj, root)

    def allgather_json(self, obj: Any) -> List[Any]:
        return allgather_json(self.comm, obj)


def _arrive(comm: Any, deadline: float, timeout: float) -> None:
    """Every rank of ``comm`` reached init, or DDLTimeoutError by ``deadline``."""
    request = comm.Ibarrier()
    while not request.Test():
        if time.monotonic() > deadline:
            raise DDLTimeoutError(
                f"ddl.init: not every rank of the MPI communicator (size {comm.Get_size()}) "
                f"called ddl.init() within {timeout:g} s (DDL_START_TIMEOUT)", op="init",
                timeout=timeout)
        time.sleep(0.001)


def start_job(cfg, comm, rank: int, size: int, deadline: float, state,
              job: Optional[tuple] = None, bind: str = "") -> Start:
    """The job of ``comm``'s ranks, collective over ``comm`` (``bcast_json(obj, root)``,
    ``allgather_json(obj)``): rank 0 starts the leader coordinator, with ``job`` (job id,
    secret) or new ones; the first rank of every other host a relay. ``bind``: this
    host's address for this job (an elastic world's, from ddlrun's probe), else
    ``DDL_BIND_ADDRESS``."""
    hostname = cfg.hostname or socket.gethostname()
    hosts: List[str] = comm.allgather_json(hostname)
    spans_hosts = len(set(hosts)) > 1
    bind = bind or os.environ.get("DDL_BIND_ADDRESS") or (
        "0.0.0.0" if spans_hosts else "127.0.0.1")
    mine: Optional[LocalCoordinator] = None
    try:
        info: dict = {}
        if rank == 0:
            try:
                job_id, secret = job or (_auth.new_job_id(), _auth.new_secret())
                mine = LocalCoordinator(job_id, secret, size, hostname, cfg.start_timeout,
                                        leader_peer_bind=f"{bind}:0" if spans_hosts else "")
                bound = mine.wait_ready(deadline)
                info = {"job_id": job_id, "secret": secret, "local": bound[0],
                        "peer": _reachable(bound[1]) if spans_hosts else ""}
            except Exception as exc:  # every rank raises it below
                info = {"error": f"{type(exc).__name__}: {exc}"}
        info = comm.bcast_json(info, 0)
        if "error" in info:
            raise BootstrapError(f"ddl.init: rank 0 (host {hosts[0]}) could not start the "
                                 f"job's leader coordinator: {info['error']}", rank=0,
                                 host=hosts[0])
        first = hosts.index(hostname)
        mine_addr: dict = {}
        if rank == first and hostname != hosts[0]:
            try:
                mine = LocalCoordinator(info["job_id"], info["secret"], size, hostname,
                                        cfg.start_timeout, leader=info["peer"],
                                        local_size=hosts.count(hostname))
                mine_addr = {"address": mine.wait_ready(deadline)[0]}
            except Exception as exc:
                mine_addr = {"error": f"{type(exc).__name__}: {exc}"}
        every = comm.allgather_json(mine_addr)
        failed = [(r, e["error"]) for r, e in enumerate(every) if "error" in e]
        if failed:
            r, why = failed[0]
            raise BootstrapError(f"ddl.init: rank {r} (host {hosts[r]}) could not start its "
                                 f"node's coordinator: {why}", rank=r, host=hosts[r])
        address = info["local"] if hostname == hosts[0] else every[first]["address"]
        values = dict(rank=rank, size=size, coordinator_addr=address, job_id=info["job_id"],
                      job_secret=info["secret"], hostname=hostname, bind_address=bind)
        return Start(cfg.replace(**values), coordinator=mine, mpi=state)
    except BaseException:
        if mine is not None:
            mine.close(timeout=0)
        raise


def _reachable(address: str) -> str:
    """``host:port`` that other hosts can dial (a wildcard bind becomes this host's IP)."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def bcast_json(comm: Any, obj: Any, root: int) -> Any:
    """``obj`` of ``root`` on every rank, as JSON bytes (buffer calls: no pickle)."""
    data = json.dumps(obj).encode() if comm.Get_rank() == root else b""
    length = np.array([len(data)], np.int64)
    comm.Bcast(length, root=root)
    buf = (np.frombuffer(data, np.uint8).copy() if comm.Get_rank() == root
           else np.empty(int(length[0]), np.uint8))
    comm.Bcast(buf, root=root)
    return json.loads(buf.tobytes().decode())


def allgather_json(comm: Any, obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order, as JSON bytes."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    counts = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([data.size], np.int64), counts)
    out = np.empty(int(counts.sum()), np.uint8)
    comm.Allgatherv(data, [out, counts.tolist()])
    objs, start = [], 0
    for n in counts.tolist():
        objs.append(json.loads(out[start:start + n].tobytes().decode()))
        start += n
    return objs
