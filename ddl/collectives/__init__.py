"""Collective algorithms: functions of (buffer, op, group, transport, deadline).

Each works for any group size >= 1 and any length, including 0. Group size 1 makes no
transport call. Every member of the group must call the same function with matching
arguments (see each function's contract).
"""

from ddl.collectives._reduce import reduce_into, reduce_ufunc
from ddl.collectives.allgather import allgatherv
from ddl.collectives.allreduce import allreduce, recursive_doubling_allreduce, ring_allreduce
from ddl.collectives.alltoall import alltoallv
from ddl.collectives.broadcast import broadcast
from ddl.collectives.reducescatter import reducescatter

__all__ = ["allgatherv", "allreduce", "alltoallv", "broadcast", "recursive_doubling_allreduce",
           "reduce_into", "reduce_ufunc", "reducescatter", "ring_allreduce"]
