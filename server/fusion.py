"""Global order and Tensor Fusion: turn the ready list into numbered responses.

Completed names wait in a ready list in completion order. :func:`flush` numbers them
with a global ``seq`` and fuses ALLREDUCEs that agree on (process set, dtype, reduce op,
prescale, postscale, joined ranks) into one response of several tensors, up to the
fusion threshold in bytes. A tensor larger than the threshold goes alone; a threshold of
0 disables fusion. Every other op, and every error, is a response of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, List, Optional, Tuple

from ddl._dtypes import from_wire
from ddl.v1 import coordinator_pb2 as pb


@dataclass
class ReadyItem:
    """A response template (no ``seq`` yet) and the ranks that receive it."""

    response: pb.Response
    recipients: Tuple[int, ...]


def tensor_bytes(dtype: int, shape) -> int:
    """Bytes of one tensor: product of the shape times the item size."""
    return math.prod(int(d) for d in shape) * from_wire(dtype).itemsize


def fusion_key(resp: pb.Response) -> Optional[Hashable]:
    """Key of responses that may share a fused buffer, or None if this one may not."""
    if resp.op != pb.ALLREDUCE or resp.HasField("error"):
        return None
    return (resp.process_set_id, resp.dtype, resp.reduce_op, resp.prescale_factor,
            resp.postscale_factor, tuple(resp.joined_ranks))


def _size(item: ReadyItem) -> int:
    return sum(tensor_bytes(item.response.dtype, t.shape) for t in item.response.tensors)


def flush(ready: List[ReadyItem], threshold: int,
          next_seq: Callable[[], int]) -> List[ReadyItem]:
    """Fuse and number ``ready`` (consumed, in order); returns the responses to send.

    Fusion scans forward from the oldest ready allreduce and pulls in later compatible
    ones while the total stays within ``threshold``; every rank sees the same result
    because the leader alone decides it.
    """
    out: List[ReadyItem] = []
    pending = list(ready)
    ready.clear()
    while pending:
        item = pending.pop(0)
        key = fusion_key(item.response)
        total = _size(item) if key is not None else 0
        if key is not None and threshold > 0 and total <= threshold:
            keep: List[ReadyItem] = []
            for other in pending:
                size = _size(other) if fusion_key(other.response) == key else -1
                if size >= 0 and total + size <= threshold:
                    item.response.tensors.extend(other.response.tensors)
                    total += size
                else:
                    keep.append(other)
            pending = keep
        item.response.seq = next_seq()
        out.append(item)
    return out
