"""A check every member of a collective makes alike: that the rows it gathered from the
members (one per member, in member order) are all equal, else the same
:class:`~ddl.MismatchError` on every member, naming two ranks and what each sent. For
what the leader cannot compare itself, such as a sparse tensor's dense shape, which
travels beside its gathered indices and values."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ddl.core.errors import MismatchError


def check_rows_agree(rows, what: str, op: str, name: Optional[str],
                     ranks: Sequence[int], hint: str = "") -> None:
    """Raise :class:`~ddl.MismatchError` unless every row of ``rows`` (member ``i``'s in
    row ``i``; ``ranks[i]`` its rank) equals the first."""
    rows = np.asarray(rows).reshape(len(ranks), -1)
    for i in range(1, len(ranks)):
        if not np.array_equal(rows[i], rows[0]):
            a, b = list(rows[0].tolist()), list(rows[i].tolist())
            raise MismatchError(
                f"{op} {name!r}: {what} mismatch: rank {ranks[0]} sent {a}, rank "
                f"{ranks[i]} sent {b}" + (f"; {hint}" if hint else ""),
                op=op, name=name or "", rank_a=ranks[0], value_a=str(a), rank_b=ranks[i],
                value_b=str(b))
