"""What makes two calls of one name "the same" for the response cache, and where a small
one's bytes travel in a cycle.

Shared by the leader (which assigns a cache slot per name and signature, and an inline
offset to small tensors) and the workers (which look their requests up by the signature
and lay out their cycle segment by the same constants).
"""

from __future__ import annotations

import numpy as np

from ddl.core import dtypes as _dtypes
from ddl.core.reduction import wire_layout
from ddl.v1 import coordinator_pb2 as pb

# Ops whose agreed response is fixed by the requests of all ranks: a cached response is
# valid while every rank's request matches the one it made then, which the cycles' vote
# (a minimum over the ranks) checks, each rank looking at its own request only.
CACHEABLE_OPS = frozenset({pb.ALLREDUCE, pb.BROADCAST, pb.ALLGATHER, pb.ALLTOALL,
                           pb.REDUCESCATTER})


def cache_signature(req: pb.Request) -> tuple:
    """Everything the leader validates about ``req``, as a hashable tuple (an unset
    scale factor is 1.0)."""
    return (req.op, req.dtype, tuple(req.shape), req.reduce_op,
            req.prescale_factor if req.HasField("prescale_factor") else 1.0,
            req.postscale_factor if req.HasField("postscale_factor") else 1.0,
            req.root_rank if req.op == pb.BROADCAST else 0, req.process_set_id,
            tuple(req.splits), req.memory, req.group_size, req.group_names)


# Each rank's slot of the cycle segment starts with an inline area: a cached call whose
# input is at most INLINE_MAX_BYTES on every rank (as it travels: see inline_bytes) gets a
# fixed place there, and its bytes ride along with the cycle's votes. The votes follow
# the area.
INLINE_AREA_BYTES = 512 * 1024
INLINE_MAX_BYTES = 64 * 1024
INLINE_ALIGN = 64
# After the votes, each slot also has a *lone place* of at least LONE_MIN_BYTES: one more
# cached call with no inline place may ride there when every rank picked the same one
# (ddl.dataplane.backends.shm.ShmVotes). It needs no place from the leader.
LONE_MIN_BYTES = 256 * 1024


def inline_bytes(req: pb.Request) -> int:
    """The bytes ``req``'s tensor takes in the inline area: its element count times the
    bytes one element travels in (:func:`ddl.core.reduction.wire_layout`) for an allreduce
    or reducescatter, or its item size for the others (an allgather's and an alltoall's
    input may differ per rank: the leader takes the largest)."""
    dtype = _dtypes.from_wire(req.dtype)
    lanes = 1
    if req.op in (pb.ALLREDUCE, pb.REDUCESCATTER):
        dtype, lanes = wire_layout(dtype, req.reduce_op)
    return int(np.prod(tuple(req.shape), dtype=np.int64)) * dtype.itemsize * lanes
