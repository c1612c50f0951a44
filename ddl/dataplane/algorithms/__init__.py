"""Collective algorithms: functions of (buffer, op, group, transport, deadline).

Each works for any group size >= 1 and any length, including 0. Group size 1 makes no
transport call. Every member of the group must call the same function with matching
arguments (see each function's contract).
"""

from ddl.dataplane.algorithms._reduce import reduce_into, reduce_ufunc
from ddl.dataplane.algorithms.allgather import allgatherv
from ddl.dataplane.algorithms.allreduce import (allreduce, recursive_doubling_allreduce,
                                                ring_allreduce)
from ddl.dataplane.algorithms.alltoall import alltoallv
from ddl.dataplane.algorithms.broadcast import broadcast
from ddl.dataplane.algorithms.reducescatter import reducescatter

__all__ = ["allgatherv", "allreduce", "alltoallv", "broadcast", "recursive_doubling_allreduce",
           "reduce_into", "reduce_ufunc", "reducescatter", "ring_allreduce"]
