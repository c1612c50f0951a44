"""torchrun (``torch.distributed.run``) as a launcher: ``torchrun --nproc-per-node 4
train.py`` runs a ddl script as it is, as ``ddlrun -np 4`` would.

torchrun hands every worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE`` (its nodes) and ``TORCHELASTIC_RUN_ID``; ddl's
rank is torchrun's ``RANK``.

* On one node the workers meet through the node's private files, as the ranks of an MPI
  job without mpi4py do (:mod:`ddl.startup.rendezvous`): nothing else to set.
* Across nodes they meet at ``DDL_RENDEZVOUS_ADDR`` (``host:port`` that rank 0 listens
  on) with the same ``DDL_JOB_SECRET`` on every node (:mod:`ddl.startup.tcp_rendezvous`).
  Both must be set: torchrun's own store accepts anyone who can reach it, so ddl's
  secret never travels through it.

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
from typing import Mapping, Optional

from ddl.core.errors import ConfigError
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
    host = env.get("MASTER_ADDR") or "<host of rank 0>"
    raise ConfigError(
        f"ddl.init() under torchrun: the job has {launcher.size} ranks on {nodes} nodes "
        f"(LOCAL_WORLD_SIZE={launcher.local_size}), and ranks on different nodes meet at "
        f"DDL_RENDEZVOUS_ADDR: set DDL_RENDEZVOUS_ADDR={host}:<a free port> and the same "
        f"DDL_JOB_SECRET on every node (export DDL_JOB_SECRET=$(python -c 'import secrets; "
        f"print(secrets.token_hex(32))') once, then pass that value to every node)",
        variable="DDL_RENDEZVOUS_ADDR", value="")
