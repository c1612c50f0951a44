"""Process sets: subsets of ranks that run collectives among themselves.

Creating or removing a set is itself a collective among its members only: every member
calls :func:`ddl.add_process_set` with the same ranks (written in :mod:`ddl._membership`);
a non-member's call, as Horovod scripts make on every rank, waits for the members'
agreement without taking part, and learns the set's id.
Collectives on disjoint sets run concurrently. The global set (id 0) always exists.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ddl.core.errors import DDLError, NotInitializedError
from ddl.runtime.runtime import is_initialized, runtime, topology
from ddl.startup.mpi import comm_ranks, is_communicator


class ProcessSet:
    """Global ranks, with the id the leader gave them once registered.

    ``ranks``: the member ranks; None for the global set; or, as Horovod's, an mpi4py
    communicator (``mpi_comm``), in a job started over MPI: its processes' ranks in the
    job, read when first needed after :func:`ddl.init` (each rank may pass its own part
    of a ``Split``; ``init(process_sets=...)`` registers every rank's on all ranks)."""

    def __init__(self, ranks: Any = None):
        self.mpi_comm: Any = None   # the global set's: the communicator init(comm=) took
        self._global = ranks is None
        self._ranks: Optional[Tuple[int, ...]] = None   # None: all ranks, or not read yet
        self.process_set_id: Optional[int] = 0 if ranks is None else None
        if is_communicator(ranks):
            self.mpi_comm = ranks
        elif ranks is not None:
            self._ranks = _check_ranks(ranks)

    @property
    def ranks(self) -> Optional[List[int]]:
        """The members, a sorted list (as Horovod's); for the global set every rank of
        the job, or None before :func:`ddl.init`."""
        key = self._key
        if key is None:
            return list(_all_ranks(topology().size)) if is_initialized() else None
        return list(key)

    @property
    def _key(self) -> Optional[Tuple[int, ...]]:
        """The members as a sorted tuple (this rank's registry's key); None for the
        global set, whose members are the job's ranks of the moment."""
        if self._ranks is None and not self._global and self.mpi_comm is not None:
            self._ranks = comm_ranks(self.mpi_comm, runtime().mpi)
        return self._ranks

    def _members(self, size: int) -> Tuple[int, ...]:
        key = self._key
        return _all_ranks(size) if key is None else key

    def size(self) -> int:
        return len(self._members(topology().size))

    def rank(self) -> int:
        """This process's index within the set, or -1 if it is not a member."""
        members = self._members(topology().size)
        me = topology().rank
        return members.index(me) if me in members else -1

    def included(self) -> bool:
        return self.rank() >= 0

    def __repr__(self) -> str:   # Horovod's form
        try:
            who: Any = list(self._members(topology().size))
        except (NotInitializedError, ValueError):
            who = ("all ranks" if self._ranks is None and self.mpi_comm is None
                   else "those of mpi_comm" if self._ranks is None else list(self._ranks))
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={who}, "
                f"mpi_comm={self.mpi_comm!r})")


def _check_ranks(ranks: Any) -> Tuple[int, ...]:
    """``ranks`` as a sorted tuple of distinct global ranks (ints >= 0); else an error
    naming the bad value (never a silent conversion: ``int(0.5)`` would be rank 0)."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"a process set takes a list of ranks (ints), not "
                        f"{type(ranks).__name__} {ranks!r}")
    ranks = list(ranks)
    for r in ranks:
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"process set ranks must be ints, but {ranks} has {r!r} "
                            f"({type(r).__name__})")
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("a process set needs at least one rank")
    negative = [r for r in ranks if r < 0]
    if negative:
        raise ValueError(f"process set ranks must be >= 0, but {ranks} has {negative}")
    if len(set(ranks)) != len(ranks):
        dups = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"process set ranks must be distinct, but {ranks} repeats {dups}")
    return tuple(sorted(ranks))


global_process_set = ProcessSet()
_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _all_ranks(size: int) -> Tuple[int, ...]:
    """The global set's members in a job of ``size`` ranks (made once: every call reads it)."""
    return tuple(range(size))


def resolve_call(ps: ProcessSet, my_rank: int) -> Tuple[int, Tuple[int, ...], str]:
    """:func:`resolve` for a collective: ``(id, members, problem)``. An unregistered set
    whose ranks this rank registered (with another ProcessSet object) resolves to that
    set with a ``problem``, so that the members waiting on the call there fail too;
    anything else :func:`resolve` refuses raises here."""
    if isinstance(ps, ProcessSet) and ps.process_set_id is None and my_rank in ps._key:
        known = runtime().process_sets.get(ps._key)
        if known is not None:
            return known, ps._key, (
                f"passed a process set that was never registered, {ps!r}; pass the "
                f"ProcessSet that ddl.add_process_set({list(ps._key)}) returned (process "
                f"set {known})")
    ps_id, members = resolve(ps, my_rank)
    return ps_id, members, ""


def resolve(ps: ProcessSet, my_rank: int) -> Tuple[int, Tuple[int, ...]]:
    """``(id, members)`` of a registered set this rank belongs to, else a clear error."""
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"process_set must be a ddl.ProcessSet, not {type(ps).__name__}")
    members = ps._members(topology().size)
    if my_rank not in members:   # also a set add_process_set gave a non-member
        raise ValueError(f"rank {my_rank} is not a member of {ps!r}")
    if ps.process_set_id is None:
        raise DDLError(f"{ps!r} is not registered; call ddl.add_process_set(ranks) first")
    return ps.process_set_id, members


def by_id(ps_id: Any) -> ProcessSet:
    """The set this rank knows by ``ps_id`` (Horovod's TensorFlow ops take ids): 0 is the
    global set; any other id is one this rank added, or saw added by calling
    :func:`ddl.add_process_set` outside it; else a ValueError naming the ids it knows."""
    if isinstance(ps_id, (bool, np.bool_)) or not isinstance(ps_id, (int, np.integer)):
        raise TypeError(f"a process set id is an int, not {type(ps_id).__name__} {ps_id!r}")
    if ps_id == 0:
        return global_process_set
    known = {i: ranks for ranks, i in runtime().process_sets.items()}
    if ps_id not in known:
        raise ValueError(f"this rank knows no process set {ps_id} (it knows "
                         f"{[0, *sorted(known)]}); ids come from ddl.add_process_set, called "
                         f"on this rank too")
    ps = ProcessSet(known[ps_id])
    ps.process_set_id = int(ps_id)
    return ps


def get_process_set_ids_and_ranks() -> Dict[int, List[int]]:
    """``{id: ranks}`` of the process sets this rank knows: the global set (0), those it
    added, and those it saw added by calling :func:`ddl.add_process_set` outside them
    (called on every rank, as Horovod's scripts do, every rank knows every set)."""
    known = {i: list(ranks) for ranks, i in runtime().process_sets.items()}
    return {0: list(_all_ranks(topology().size)), **dict(sorted(known.items()))}


def comm_process_set_id(comm: Any) -> int:
    """The id of the registered process set of mpi4py communicator ``comm``'s processes
    (0 when they are all ranks); a ValueError when this rank knows no such set."""
    ranks = ProcessSet(comm)._key
    if ranks == _all_ranks(topology().size):
        return 0
    found = runtime().process_sets.get(ranks)
    if found is None:
        raise ValueError(f"no process set of ranks {list(ranks)} (the communicator's) is "
                         f"registered on this rank; add it with ddl.add_process_set"
                         f"(ddl.ProcessSet(comm)) or init(process_sets=[...])")
    return found


def record(ps: ProcessSet, ps_id: Optional[int]) -> None:
    """Note the id the leader gave ``ps`` (None: it was removed), on ``ps`` and in this
    rank's registry (which :func:`resolve_call` reads)."""
    with _lock:
        ps.process_set_id = ps_id
        if ps_id is None:
            runtime().process_sets.pop(ps._key, None)
        else:
            runtime().process_sets[ps._key] = ps_id
