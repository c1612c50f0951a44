"""Rank topology: local and cross ranks from the host each rank registered with.

Hosts are ordered by their lowest rank. Within a host, ranks are ordered by rank.

* ``local_rank``: position of the rank among the ranks of its host;
* ``local_size``: number of ranks on its host;
* ``cross_rank``: number of earlier hosts that have a rank with the same local rank;
* ``cross_size``: number of hosts whose ``local_size`` exceeds this ``local_rank``;
* ``is_homogeneous``: every host runs the same number of ranks.

Example: hosts ``h1:3,h2:1`` put ranks 0, 1, 2 on h1 and rank 3 on h2; rank 3 has
local rank 0, cross rank 1, cross size 2; rank 1 has local rank 1, cross rank 0 and
cross size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class RankTopology:
    """Where one rank sits among the hosts of the job."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool


def compute_topology(hostnames: Sequence[str]) -> List[RankTopology]:
    """Topology of every rank; ``hostnames[r]`` is the host of rank ``r``."""
    by_host: Dict[str, List[int]] = {}
    for rank, host in enumerate(hostnames):
        by_host.setdefault(host, []).append(rank)  # ranks ascend: dict keeps host order
    hosts = list(by_host.values())  # ordered by lowest rank, since ranks ascend
    sizes = [len(ranks) for ranks in hosts]
    homogeneous = len(set(sizes)) <= 1
    out: List[RankTopology] = [None] * len(hostnames)  # type: ignore[list-item]
    for host_index, ranks in enumerate(hosts):
        for local_rank, rank in enumerate(ranks):
            cross_rank = sum(1 for s in sizes[:host_index] if s > local_rank)
            cross_size = sum(1 for s in sizes if s > local_rank)
            out[rank] = RankTopology(local_rank, len(ranks), cross_rank, cross_size,
                                     homogeneous)
    return out
