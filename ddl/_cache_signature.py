"""What makes two calls of one name "the same" for the response cache.

Shared by the leader (which assigns a cache slot per name and signature) and the workers
(which look their requests up by it), so both compute it from a request the same way.
"""

from __future__ import annotations

from ddl.v1 import coordinator_pb2 as pb

# Ops whose agreed response depends only on the request itself (not on other ranks'
# shapes, as allgather's and alltoall's do).
CACHEABLE_OPS = frozenset({pb.ALLREDUCE, pb.BROADCAST})


def _scale(req: pb.Request, field: str) -> float:
    return float(getattr(req, field)) if req.HasField(field) else 1.0


def cache_signature(req: pb.Request) -> tuple:
    """Everything the leader validates about ``req``, as a hashable tuple."""
    return (req.op, req.dtype, tuple(req.shape), req.reduce_op,
            _scale(req, "prescale_factor"), _scale(req, "postscale_factor"),
            req.root_rank if req.op == pb.BROADCAST else 0, req.process_set_id)
