"""Global order and Tensor Fusion: turn the ready list into numbered responses.

Completed names wait in a ready list in completion order. :func:`flush` numbers them
with a global ``seq`` and fuses ALLREDUCEs by the rule of :mod:`ddl.core.fusion` (shared with
the response cache's cycles): those that agree on (process set, dtype, reduce op,
prescale, postscale, joined ranks) share one response of several tensors, up to the
fusion threshold in bytes. Every other op, and every error, is a response of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

from ddl.core.fusion import fuse
from ddl.v1 import coordinator_pb2 as pb


@dataclass
class ReadyItem:
    """A response template (no ``seq`` yet) and the ranks that receive it."""

    response: pb.Response
    recipients: Tuple[int, ...]


def flush(ready: List[ReadyItem], threshold: int,
          next_seq: Callable[[], int]) -> List[ReadyItem]:
    """Fuse and number ``ready`` (consumed, in order); returns the responses to send.

    Every rank sees the same result because the leader alone decides it.
    """
    out: List[ReadyItem] = []
    groups = fuse(ready, threshold, lambda item: item.response)
    ready.clear()
    for first, *rest in groups:
        for other in rest:
            first.response.tensors.extend(other.response.tensors)
        first.response.seq = next_seq()
        out.append(first)
    return out
