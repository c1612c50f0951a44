"""MPI and Slurm: who started this process, and mpi4py when it is there.

ddl uses MPI only to start: rank, size and node layout come from the MPI launcher's
environment (or an mpi4py communicator), and the job's addresses and secret travel over
the communicator. Tensor bytes never go through MPI, so MPI and ddl calls mix freely.

Launchers recognised, first match wins:

=================  ================================================================
Open MPI           ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
MPICH / Hydra,     ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
Intel MPI
Slurm ``srun``     ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``),
                   ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE`` + ``SLURM_NODEID``;
                   only inside a job step (``SLURM_STEP_ID`` set), so a batch script
                   that runs ``python train.py`` without ``srun`` stays one process
=================  ================================================================

Importing this module never imports mpi4py (importing ``mpi4py.MPI`` initialises MPI).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

from ddl.core.errors import ConfigError, MPINotEnabledError


@dataclass(frozen=True)
class LauncherEnv:
    """What the MPI or Slurm launcher says about this process."""

    launcher: str  # "Open MPI", "MPICH/Hydra", "Slurm", "torchrun"
    rank: int
    size: int
    local_rank: int
    local_size: int
    job_key: str  # the same on every local rank of one job: names the node's rendezvous
    mpi: bool = True  # an MPI launcher (False: torchrun, where MPI takes no part)


def _int(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} (set by the MPI or Slurm launcher) is not an "
                          f"integer", variable=name, value=text) from None


def _slurm_tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node ``node`` from Slurm's compressed list, e.g. ``2(x3),1``."""
    counts: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not a Slurm task list",
                              variable="SLURM_STEP_TASKS_PER_NODE", value=spec)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE={spec!r}",
                          variable="SLURM_NODEID", value=str(node))
    return counts[node]


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[LauncherEnv]:
    """The MPI or Slurm launcher of this process, or None when there is none."""
    env = os.environ if environ is None else environ
    if "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
        key = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid", "")
        return LauncherEnv("Open MPI", _int(env, "OMPI_COMM_WORLD_RANK"),
                           _int(env, "OMPI_COMM_WORLD_SIZE"),
                           _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                           _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                           rendezvous_key("ompi", key))
    if "PMI_SIZE" in env and "PMI_RANK" in env and "MPI_LOCALNRANKS" in env:
        return LauncherEnv("MPICH/Hydra", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                           _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"),
                           rendezvous_key("pmi", env.get("PMI_KVSNAME", "")))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        if size_var not in env:
            return None
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
        size = _int(env, size_var)
        local_size = _slurm_tasks_on_node(spec, node) if spec else size
        return LauncherEnv("Slurm", _int(env, "SLURM_PROCID"), size,
                           _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                           local_size,
                           rendezvous_key("slurm", f"{env.get('SLURM_JOB_ID', '')}."
                                                   f"{env.get('SLURM_STEP_ID', '')}"))
    return None


def rendezvous_key(kind: str, launcher_key: str) -> str:
    """A file-name-safe key for this job on this node. Without a job id from the
    launcher, the parent process (the launcher's per-node daemon) stands in for it."""
    raw = launcher_key if launcher_key.strip(".") else f"ppid{os.getppid()}"
    return f"{kind}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", raw)[:80]


def mpi4py_available() -> bool:
    """Whether mpi4py is installed (found, not imported)."""
    return importlib.util.find_spec("mpi4py") is not None


def import_mpi():
    """``mpi4py.MPI`` (this initialises MPI with MPI_THREAD_MULTIPLE if it is not yet)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"mpi4py cannot be imported ({exc}); pip install mpi4py "
                          f"(built against your MPI; or the mpich wheel with it)", variable="comm",
                          value="mpi4py") from exc
    return MPI


def is_communicator(obj: Any) -> bool:
    """Whether ``obj`` looks like an mpi4py communicator (without importing mpi4py)."""
    return type(obj).__module__.startswith("mpi4py") and hasattr(obj, "Get_size")


@dataclass(frozen=True)
class MpiState:
    """How MPI took part in this job, for :func:`ddl.mpi_enabled` and friends."""

    launcher: str  # "Open MPI", "MPICH/Hydra", "Slurm", or "mpi4py communicator"
    thread_level: Optional[int]  # MPI.Query_thread(), None when MPI was not initialised
    # the MPI group of the communicator whose ranks are the job's (ddl rank = rank in
    # it), when the job started over one: process sets made of communicators map into it
    group: Any = None


def comm_ranks(comm: Any, state: Optional[MpiState]) -> Tuple[int, ...]:
    """The ddl ranks of communicator ``comm``'s processes (sorted), in the job of
    ``state``; a ValueError when the job did not start over MPI or ``comm`` holds
    processes outside it."""
    if state is None or state.group is None:
        raise ValueError("a process set made of an mpi4py communicator needs a job started "
                         "over MPI (mpirun/srun, ddlrun --mpi, or ddl.init(comm=...)); pass "
                         "the set's ranks instead")
    MPI = import_mpi()
    group = comm.Get_group()
    try:
        mapped = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), state.group)
    finally:
        group.Free()
    outside = [i for i, r in enumerate(mapped) if r == MPI.UNDEFINED]
    if outside:
        raise ValueError(f"the communicator's ranks {outside} are not in this ddl job (its "
                         f"ranks are those of the communicator it started over)")
    return tuple(sorted(int(r) for r in mapped))


# -- the public queries ---------------------------------------------------------------------

def mpi_built() -> bool:
    """Whether ddl can use MPI here: mpi4py is installed and imports (this initialises
    MPI). Needs no ``init``."""
    if not mpi4py_available():
        return False
    try:
        import_mpi()
    except ConfigError:
        return False
    return True


def threads_supported(state: Optional[MpiState]) -> bool:
    """:func:`ddl.mpi_threads_supported` for a job whose start left ``state`` (None: MPI
    did not start it, MPINotEnabledError)."""
    if state is None:
        raise MPINotEnabledError("ddl.mpi_threads_supported(): this job was not started by "
                                 "MPI (start it with mpirun, srun, ddlrun --mpi or "
                                 "ddl.init(comm=...))", op="mpi_threads_supported")
    MPI = import_mpi()
    level = state.thread_level if state.thread_level is not None else MPI.Query_thread()
    return level == MPI.THREAD_MULTIPLE
