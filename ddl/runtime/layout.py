"""Where tensors sit in the buffers a response moves: shared by the host executor
(:mod:`ddl.runtime.execute`) and the device one (:mod:`ddl.runtime.device_execute`), so
that both lay a response out alike on every member."""

from __future__ import annotations

from typing import List, Sequence


def row_split(rows: int, parts: int) -> List[int]:
    """Rows per member along dim 0: as even as possible, earlier members get the extra."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def starts(counts: Sequence[int], align: int) -> List[int]:
    """Where each of ``counts`` elements starts in a buffer that holds them back to back,
    each start a multiple of ``align`` elements; the last entry is the buffer's length."""
    out = [0]
    for count in counts:
        out.append(out[-1] + -(-count // align) * align)
    if align > 1 and counts:  # the last one needs no padding after it
        out[-1] = out[-2] + counts[-1]
    return out
