"""Tensor Fusion's rule, the one used by the leader (``server/fusion.py``) and by the
response cache's cycles (:mod:`ddl.runtime.cycles`).

Two ALLREDUCE responses may share one fused buffer when they agree on (process set,
dtype, reduce op, prescale, postscale, joined ranks, memory: host tensors never share a
buffer with device ones). :func:`fuse` scans forward from the
oldest response and pulls in later compatible ones while the total stays within the
threshold in bytes; a response larger than the threshold goes alone, and a threshold of
0 disables fusion. Every other op, and every error, stays alone. The rule depends only
on the responses and their order, so every rank that applies it to the same list gets
the same groups. The default threshold is ``DDL_FUSION_THRESHOLD``'s (:mod:`ddl.core.config`).
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, List, Optional, Sequence, TypeVar

from ddl.core import config as _config
from ddl.core.dtypes import from_wire
from ddl.v1 import coordinator_pb2 as pb

DEFAULT_THRESHOLD: int = _config.var("DDL_FUSION_THRESHOLD").default

T = TypeVar("T")


def tensor_bytes(dtype: int, shape) -> int:
    """Bytes of one tensor: product of the shape times the item size."""
    return math.prod(int(d) for d in shape) * from_wire(dtype).itemsize


def response_bytes(resp: pb.Response) -> int:
    """Bytes of all of ``resp``'s tensors."""
    return sum(tensor_bytes(resp.dtype, t.shape) for t in resp.tensors)


def fusion_key(resp: pb.Response) -> Optional[Hashable]:
    """Key of responses that may share a fused buffer, or None if this one may not."""
    if resp.op != pb.ALLREDUCE or resp.HasField("error"):
        return None
    return (resp.process_set_id, resp.dtype, resp.reduce_op, resp.prescale_factor,
            resp.postscale_factor, tuple(resp.joined_ranks), resp.memory)


def fuse(items: Sequence[T], threshold: int,
         response: Callable[[T], pb.Response] = lambda x: x) -> List[List[T]]:
    """``items`` cut into fusion groups (see the module doc), each in order, the groups
    ordered by their first item; ``response(item)`` is an item's response."""
    out: List[List[T]] = []
    pending = list(items)
    while pending:
        item = pending.pop(0)
        group = [item]
        key = fusion_key(response(item)) if pending else None  # alone: nothing to fuse
        total = response_bytes(response(item)) if key is not None else 0
        if key is not None and threshold > 0 and total <= threshold:
            keep: List[T] = []
            for other in pending:
                size = (response_bytes(response(other))
                        if fusion_key(response(other)) == key else -1)
                if size >= 0 and total + size <= threshold:
                    group.append(other)
                    total += size
                else:
                    keep.append(other)
            pending = keep
        out.append(group)
    return out
