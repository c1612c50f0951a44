"""torchrun (``torch.distributed.run``) as a launcher: ``torchrun --nproc-per-node 4
train.py`` runs a ddl script as it is, as ``ddlrun -np 4`` would.

torchrun hands every worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE`` (its nodes) and ``TORCHELASTIC_RUN_ID``; ddl's
rank is torchrun's ``RANK``.

* On one node the workers meet through the node's private files, as the ranks of an MPI
  job without mpi4py do (:mod:`ddl.startup.rendezvous`): nothing else to set.
* Across nodes they meet at rank 0 over authenticated TCP
  (:mod:`ddl.startup.tcp_rendezvous`), with the same ``DDL_JOB_SECRET`` on every node:
  torchrun's own store accepts anyone who can reach it, so ddl's secret never travels
  through it. Rank 0 listens on a free port of its node and publishes the port in
  torchrun's store (``MASTER_ADDR:MASTER_PORT``, the agent's store that torchrun hands
  its workers); the others read it there and dial ``MASTER_ADDR`` (the node of global
  rank 0, which torchrun's rendezvous chose, also under ``--rdzv-backend c10d``). A port
  that someone else wrote into the store costs no secret: the handshake proves the secret
  both ways, so a rank refuses a listener that cannot. ``DDL_RENDEZVOUS_ADDR``, if set,
  names rank 0's address instead, and the store is not used.

Each of torchrun's restarts (``--max-restarts``) starts a new ddl job. MPI takes no part:
``ddl.mpi_enabled()`` is False.

Without torchrun, ``RANK`` and ``WORLD_SIZE`` (torch.distributed's ``env://``, as a
Kubeflow PyTorchJob sets them) are the ranks of a ``DDL_RENDEZVOUS_ADDR`` start-up; with
``WORLD_SIZE`` > 1 and no ``DDL_RENDEZVOUS_ADDR``, ``init`` says what to set rather than
train alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from datetime import timedelta
from typing import Mapping, Optional

from ddl.core.errors import BootstrapError, ConfigError, DDLTimeoutError
from ddl.startup import mpi as _mpi

LAUNCHER = "torchrun"
ENV_LAUNCHER = "torch.distributed's RANK and WORLD_SIZE"


def _ints(env: Mapping[str, str], names, who: str) -> dict:
    """``names`` (rank, size[, local rank, local size]) read strictly: non-negative
    integers, each rank below its size."""
    values = {}
    for name in names:
        text = env.get(name, "")
        if not re.fullmatch(r"[0-9]+", text.strip()):
            raise ConfigError(f"{name}={text!r} (set by {who}) is not a non-negative "
                              f"integer", variable=name, value=text)
        values[name] = int(text)
    for rank, size in zip(names[::2], names[1::2]):
        if not values[rank] < values[size]:
            raise ConfigError(f"{rank}={values[rank]} (set by {who}) is not below "
                              f"{size}={values[size]}", variable=rank, value=str(values[rank]))
    return values


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[_mpi.LauncherEnv]:
    """This worker of torchrun, or None when torchrun did not start this process."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    values = _ints(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "torchrun")
    # the node's workers share the run, the restart and the agent's store (its port is
    # this job's alone on the node); their parents may differ (torchrun --no-python)
    ident = "|".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                             "MASTER_ADDR", "MASTER_PORT"))
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return _mpi.LauncherEnv(LAUNCHER, values["RANK"], values["WORLD_SIZE"],
                            values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"],
                            _mpi.rendezvous_key("torchrun", key), mpi=False)


def meets_through_store(launcher: _mpi.LauncherEnv, job_secret: Optional[str],
                        environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether torchrun's workers on several nodes can meet through torchrun's store:
    torchrun (not torch.distributed's bare variables) hands them its agent's store, and
    ``DDL_JOB_SECRET`` is set."""
    env = os.environ if environ is None else environ
    return (launcher.launcher == LAUNCHER and launcher.local_size != launcher.size
            and bool(job_secret) and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and bool(env.get("MASTER_ADDR")) and env.get("MASTER_PORT", "").isdigit())


def store_key(environ: Mapping[str, str]) -> str:
    """Where rank 0's port goes in torchrun's store: one key per run and restart."""
    return (f"ddl/rendezvous-port/{environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def rendezvous_through_store(rank: int, deadline: float, timeout: float,
                             environ: Optional[Mapping[str, str]] = None):
    """(the rendezvous address for this rank, and on rank 0 the function that publishes
    its port): rank 0 listens on any free port of ``MASTER_ADDR``'s node; the others wait,
    until ``deadline``, for that port in torchrun's store."""
    env = os.environ if environ is None else environ
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    where = f"torchrun's store at MASTER_ADDR:MASTER_PORT={host}:{port}"
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        raise ConfigError(f"ddl.init() under torchrun over several nodes reads rank 0's "
                          f"port from {where}, which needs torch.distributed ({exc}); or "
                          f"set DDL_RENDEZVOUS_ADDR=<host of rank 0>:<a free port>",
                          variable="DDL_RENDEZVOUS_ADDR", value="") from None
    left = max(deadline - time.monotonic(), 0.001)
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=left),
                         wait_for_workers=False)
    except Exception as exc:   # torch's DistStoreError/RuntimeError: could not connect
        raise DDLTimeoutError(f"ddl.init: rank {rank} could not reach {where} within "
                              f"{timeout:g} s (DDL_START_TIMEOUT): {exc}", op="init",
                              timeout=timeout) from None
    key = store_key(env)
    if rank == 0:
        return f"{host}:0", lambda listening: store.set(key, str(listening))
    try:
        store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        text = store.get(key).decode("ascii", "replace")
    except Exception as exc:   # torch's DistStoreError: the wait timed out, or the store left
        raise DDLTimeoutError(f"ddl.init: rank {rank} waited {timeout:g} s "
                              f"(DDL_START_TIMEOUT) for rank 0's port in {where} (key "
                              f"{key!r}): rank 0 has not started ddl.init ({exc})",
                              op="init", timeout=timeout) from None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise BootstrapError(f"ddl.init: rank {rank} read {text[:40]!r} as rank 0's port "
                             f"from {where} (key {key!r}), which is no port", rank=0)
    return f"{host}:{int(text)}", None


def detect_env(environ: Optional[Mapping[str, str]] = None) -> Optional[_mpi.LauncherEnv]:
    """torch.distributed's ``env://`` variables without torchrun (a Kubeflow PyTorchJob,
    a launcher of one's own): ``RANK`` and ``WORLD_SIZE``, which say nothing of the
    ranks' hosts (local rank and size 0: unknown). None when they are not both set."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    values = _ints(env, ("RANK", "WORLD_SIZE"), "the environment")
    return _mpi.LauncherEnv(ENV_LAUNCHER, values["RANK"], values["WORLD_SIZE"], 0, 0, "",
                            mpi=False)


def check_one_node(launcher: _mpi.LauncherEnv,
                   environ: Optional[Mapping[str, str]] = None) -> None:
    """A ConfigError, saying what to set, when torchrun's job spans nodes (the node's
    files do not cross nodes), or the ranks of torch.distributed's variables have no
    ``DDL_RENDEZVOUS_ADDR`` to meet at."""
    if launcher.local_size == launcher.size:
        return
    env = os.environ if environ is None else environ
    if launcher.launcher == ENV_LAUNCHER:
        host = env.get("MASTER_ADDR") or "<host of rank 0>"
        raise ConfigError(
            f"ddl.init(): RANK={launcher.rank} and WORLD_SIZE={launcher.size} are set "
            f"(torch.distributed's env:// start-up, e.g. a Kubeflow PyTorchJob), but not "
            f"where the ranks meet: set DDL_RENDEZVOUS_ADDR={host}:<a free port> and the "
            f"same DDL_JOB_SECRET on every rank, or start the job with ddlrun or torchrun",
            variable="DDL_RENDEZVOUS_ADDR", value="")
    nodes = env.get("GROUP_WORLD_SIZE", "several")
    secret = ("export DDL_JOB_SECRET=$(python -c 'import secrets; print(secrets."
              "token_hex(32))') once, then pass that value to every node")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"ddl.init() under torchrun: the job has {launcher.size} ranks on {nodes} nodes "
            f"(LOCAL_WORLD_SIZE={launcher.local_size}), and ranks on different nodes prove "
            f"a shared secret to each other: set the same DDL_JOB_SECRET on every node "
            f"({secret})", variable="DDL_JOB_SECRET", value="")
    host = env.get("MASTER_ADDR") or "<host of rank 0>"
    raise ConfigError(
        f"ddl.init() under torchrun: the job has {launcher.size} ranks on {nodes} nodes "
        f"(LOCAL_WORLD_SIZE={launcher.local_size}), and ranks on different nodes meet at "
        f"DDL_RENDEZVOUS_ADDR: set DDL_RENDEZVOUS_ADDR={host}:<a free port> and the same "
        f"DDL_JOB_SECRET on every node ({secret})", variable="DDL_RENDEZVOUS_ADDR", value="")
