"""Joining the job with Horovod's static process sets, and adding and removing process
sets: each is an agreement among the set's members at the leader (ranks outside the set
may call it too, and wait to learn the outcome), written beside the collectives of
:mod:`ddl._api`; :mod:`ddl._process_sets` holds the sets themselves.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from ddl._api import allgather
from ddl._process_sets import ProcessSet, global_process_set, record, resolve
from ddl.core import dtypes as _dtypes
from ddl.core.errors import DDLError
from ddl.runtime.engine import Entry
from ddl.runtime.handle import Handle
from ddl.runtime.runtime import init as _join, is_initialized, runtime, topology
from ddl.startup.mpi import is_communicator
from ddl.v1 import coordinator_pb2 as pb


# -- joining, with Horovod's static process sets ----------------------------------------

def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (idempotent). Every rank of the job must call it.

    Under ``ddlrun``/``ddl.run`` the rank and coordinator come from the environment;
    under ``mpirun``/``srun`` from the MPI or Slurm launcher's environment; as a plain
    process it starts a size-1 job with an embedded coordinator.

    ``comm``: an mpi4py communicator, whose ranks become one independent ddl job (ddl
    rank = rank in ``comm``; a collective call over ``comm``), or a list of
    ``COMM_WORLD`` ranks (only those ranks call init). See :mod:`ddl.startup.bootstrap`.

    ``process_sets``: Horovod's static process sets, the same list on every rank: each
    entry (a :class:`ProcessSet` or a list of ranks) is registered after joining, in
    order, as :func:`add_process_set` registers it (a ProcessSet given gets its id, on
    members and non-members alike), also when this process had joined
    already (``ddl.run``, the Ray and Spark executors join before the user's function
    runs); a set this rank registered before is taken as it is, and an entry of every
    rank is the global set. An entry may be a ``ProcessSet(comm)`` of an mpi4py
    communicator that differs per rank (each rank's part of a ``Split``), at the same
    positions on every rank: the ranks then swap their parts, and every distinct part
    is registered on all of them, in rank order. ``"dynamic"`` (Horovod's mode for sets
    added later) is accepted: here sets can always be added and removed later.
    """
    _join(comm)
    if is_communicator(comm):
        global_process_set.mpi_comm = comm   # as Horovod's
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, (str, bytes)) or not hasattr(process_sets, "__iter__"):
        raise TypeError(f"init: process_sets takes a list of ProcessSets or rank lists (or "
                        f"'dynamic'), not {process_sets!r}")
    everyone = tuple(range(topology().size))
    for ps in _every_rank_parts([e if isinstance(e, ProcessSet) else ProcessSet(e)
                                 for e in process_sets]):
        if ps._key is None or ps._key == everyone:
            ps.process_set_id = 0   # the global set, which is there already
            continue
        known = runtime().process_sets.get(ps._key)
        if known is not None:   # registered by an earlier init: no second agreement
            record(ps, known)
            continue
        add_process_set(ps)


def _every_rank_parts(sets: List[ProcessSet]) -> List[ProcessSet]:
    """``sets`` in order, where an entry made of a communicator stands for every rank's
    part at that position (swapped among all ranks): this rank's own part, and the
    others' as sets of their ranks, in rank order, each once."""
    if not any(ps.mpi_comm is not None for ps in sets):
        return sets
    n = topology().size
    rows = np.full((len(sets), n), -1, np.int8)   # per entry: a mask of its part's ranks
    for row, ps in zip(rows, sets):
        if ps.mpi_comm is not None:
            row[:] = 0
            row[list(ps._key)] = 1
    every = allgather(rows, name="init.process_sets")
    if every.shape[0] != n * len(sets):
        raise ValueError(f"init: process_sets lists of other lengths on other ranks "
                         f"({every.shape[0]} entries in all, {len(sets)} here, {n} ranks); "
                         f"pass the same number of entries on every rank")
    every = every.reshape(n, len(sets), n)
    out: List[ProcessSet] = []
    for i, ps in enumerate(sets):
        if ps.mpi_comm is None:
            out.append(ps)
            continue
        parts: List[Tuple[int, ...]] = []
        for theirs in every[:, i]:
            part = tuple(int(r) for r in np.flatnonzero(theirs == 1))
            if theirs[0] >= 0 and part not in parts:
                parts.append(part)
        out.extend(ps if part == ps._key else ProcessSet(part) for part in parts)
    return out


# -- process sets: creating and removing one is a collective among its members ----------

def add_process_set(ranks) -> ProcessSet:
    """Register a process set: every member calls this with the same ranks, and returns
    once all of them have. Other ranks may call it too, as Horovod scripts do on every
    rank: such a call returns once the members have registered the set, with its id
    (the same on every rank), and never holds the members up.

    Returns a :class:`ProcessSet` to pass as ``process_set=``. Adding a set with the same
    ranks as an existing one returns a set with the existing id. A non-member's set has
    ``included()`` False and ``rank()`` -1, and its collectives on it raise
    ``ValueError``.

    Example::

        evens = ddl.add_process_set([0, 2])          # on every rank, or on 0 and 2 only
        if evens.included():
            ddl.allreduce(x, process_set=evens)
    """
    try:
        if ranks is None:   # ProcessSet(None) is the global set, which is never added
            raise TypeError("add_process_set: ranks is None; pass the member ranks, e.g. "
                            "add_process_set([0, 1])")
        ps = ranks if isinstance(ranks, ProcessSet) else ProcessSet(ranks)
        if ps._key is None:
            raise ValueError("add_process_set: the global process set is there already "
                             "(ddl.global_process_set); pass the member ranks of a subset")
        size = topology().size
        bad = [r for r in ps._key or () if not 0 <= r < size]
        if bad:
            raise ValueError(f"add_process_set: ranks {bad} are outside [0, {size})")
    except (TypeError, ValueError) as exc:
        # the others that listed this rank wait for it: the leader tells them (the set's
        # name comes from its ranks, so it fails every add_process_set waiting for us)
        if is_initialized():
            why = str(exc).removeprefix("add_process_set: ")
            try:
                _enqueue_membership(pb.ADD_PROCESS_SET, None, local_error=(
                    f"passed invalid ranks {ranks!r}: {why}")).wait()
            except DDLError:
                pass
        raise
    new_id, _members = _enqueue_membership(pb.ADD_PROCESS_SET, ps).wait()
    record(ps, new_id)
    return ps


def remove_process_set(ps: ProcessSet) -> None:
    """Drop a registered set; every member calls it, and returns once all of them have.
    A non-member may call it too (as :func:`add_process_set`, Horovod scripts call it on
    every rank): it returns once the members have removed the set. Either way ``ps``'s
    ``process_set_id`` is None afterwards. The global set cannot be removed."""
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"remove_process_set takes a ddl.ProcessSet, not "
                        f"{type(ps).__name__} {ps!r}")
    if ps is global_process_set or ps.process_set_id == 0:
        raise ValueError("the global process set cannot be removed")
    if topology().rank in ps._key:
        resolve(ps, topology().rank)
    elif ps.process_set_id is None:
        return   # a non-member's set it never learnt the id of: nothing to wait for
    _enqueue_membership(pb.REMOVE_PROCESS_SET, ps).wait()
    record(ps, None)


def _enqueue_membership(op: int, ps: Optional[ProcessSet], local_error: str = "") -> Handle:
    """Submit an ADD/REMOVE_PROCESS_SET agreement among ``ps``'s members, or, from a
    rank outside it, the wait for its outcome (an add_process_set whose ranks are
    invalid: ``ps`` None and what is wrong)."""
    rt = runtime()
    opname = _dtypes.op_name(op)
    if local_error:
        request = pb.Request(name=f"{opname}/?", op=op, process_set_id=0,
                             local_error=local_error)
    elif op == pb.ADD_PROCESS_SET:
        ranks = ",".join(str(r) for r in ps._key)
        request = pb.Request(name=f"{opname}/{ranks}", op=op, process_set_id=0,
                             member_ranks=list(ps._key))
    else:   # the members, so that the leader knows a non-member's call as such
        request = pb.Request(name=f"{opname}/{ps.process_set_id}", op=op,
                             process_set_id=ps.process_set_id, member_ranks=list(ps._key))
    handle = Handle(opname, request.name, rt.config.collective_timeout)
    rt.engine.submit([Entry(request, None, handle)])
    return handle
