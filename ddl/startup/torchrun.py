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
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from ddl.core.errors import ConfigError
from ddl.startup import mpi as _mpi

LAUNCHER = "torchrun"


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[_mpi.LauncherEnv]:
    """This worker of torchrun, or None when torchrun did not start this process."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        text = env.get(name, "")
        if not text.strip().isdigit():
            raise ConfigError(f"{name}={text!r} (set by torchrun) is not a non-negative "
                              f"integer", variable=name, value=text)
        values[name] = int(text)
    # the node's workers share the run id, the restart and their parent (the agent)
    key = (f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
           f".ppid{os.getppid()}")
    return _mpi.LauncherEnv(LAUNCHER, values["RANK"], values["WORLD_SIZE"],
                            values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"],
                            _mpi.rendezvous_key("torchrun", key), mpi=False)


def check_one_node(launcher: _mpi.LauncherEnv,
                   environ: Optional[Mapping[str, str]] = None) -> None:
    """A ConfigError, saying what to set, when torchrun's job spans nodes and
    ``DDL_RENDEZVOUS_ADDR`` is not set (the node's files do not cross nodes)."""
    if launcher.local_size == launcher.size:
        return
    env = os.environ if environ is None else environ
    nodes = env.get("GROUP_WORLD_SIZE", "several")
    host = env.get("MASTER_ADDR") or "<host of rank 0>"
    raise ConfigError(
        f"ddl.init() under torchrun: the job has {launcher.size} ranks on {nodes} nodes "
        f"(LOCAL_WORLD_SIZE={launcher.local_size}), and ranks on different nodes meet at "
        f"DDL_RENDEZVOUS_ADDR: set DDL_RENDEZVOUS_ADDR={host}:<a free port> and the same "
        f"DDL_JOB_SECRET on every node (export DDL_JOB_SECRET=$(python -c 'import secrets; "
        f"print(secrets.token_hex(32))') once, then pass that value to every node)",
        variable="DDL_RENDEZVOUS_ADDR", value="")
