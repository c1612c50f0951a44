"""Collectives over several hosts in three stages: shared memory within each host, TCP
across hosts, shared memory again.

A :class:`Hierarchy` describes a group whose hosts each hold the same number L >= 2 of
its members: ``local`` (this rank's host mates), ``cross`` (the member at this rank's
position on every host) and ``hosts`` (every host's members, ascending). Member k of a
host only ever talks across hosts with member k of the others, so the L cross groups run
at once on separate connections, and each host sends only its own data across once.

Cross-rank contract: every member calls the same function with the same arguments
(counts, op, dtype) and the same hierarchy, as for the flat collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from ddl.dataplane.algorithms import shm_collectives
from ddl.dataplane.algorithms._buffers import as_uint8, even_offsets, offsets
from ddl.dataplane.algorithms.allgather import allgatherv as tcp_allgatherv
from ddl.dataplane.algorithms.allreduce import allreduce as tcp_allreduce
from ddl.dataplane.transports.base import Group, Transport


@dataclass(frozen=True)
class Hierarchy:
    local: Group
    cross: Group
    hosts: Tuple[Tuple[int, ...], ...]  # each host's members (global ranks), ascending


def allreduce(buf: np.ndarray, op: int, h: Hierarchy, lshm, transport: Transport,
              deadline: float, **tcp) -> None:
    """Reduce ``buf`` in place: reduce-scatter within the host, allreduce of this rank's
    share with the same share on every other host (``tcp``: the TCP algorithm's
    settings), allgather of the shares within the host."""
    bounds = even_offsets(buf.size, h.local.size)
    counts = [bounds[k + 1] - bounds[k] for k in range(h.local.size)]
    shm_collectives.reducescatter(buf, counts, op, lshm, deadline)
    start = sum(counts[:h.local.index])
    share = buf[start:start + counts[h.local.index]]
    tcp_allreduce(share, op, h.cross, transport, deadline, **tcp)
    item = buf.dtype.itemsize
    shm_collectives.allgatherv(share.view(np.uint8), buf.view(np.uint8),
                               [c * item for c in counts], lshm, deadline)


def allgatherv(send, out, counts: Sequence[int], group: Group, h: Hierarchy, lshm,
               transport: Transport, deadline: float) -> None:
    """Every member's bytes, in ``group`` member order, into ``out`` (``counts``: bytes
    per member of ``group``): gather the host's blocks over shared memory; split the
    host's bytes into L shares and gather share k of every host across hosts (member k);
    gather those within the host; put each member's block in place."""
    dst = as_uint8(out, "hierarchical allgatherv out")
    index = {r: i for i, r in enumerate(group.ranks)}
    L, me = h.local.size, h.local.index
    # 1. this host's blocks, in local order
    host_counts = [[int(counts[index[r]]) for r in members] for members in h.hosts]
    mine = h.hosts.index(h.local.ranks)
    blob = np.empty(sum(host_counts[mine]), np.uint8)
    shm_collectives.allgatherv(send, blob, host_counts[mine], lshm, deadline)
    # 2. share k of every host, across hosts; hosts in the order of their member k
    shares = [even_offsets(sum(c), L) for c in host_counts]  # byte bounds per host

    def order(k: int):
        return sorted(range(len(h.hosts)), key=lambda x: h.hosts[x][k])

    def share_size(host: int, k: int) -> int:
        return shares[host][k + 1] - shares[host][k]

    mine_order = order(me)
    got = np.empty(sum(share_size(x, me) for x in mine_order), np.uint8)
    tcp_allgatherv(blob[shares[mine][me]:shares[mine][me + 1]], got,
                   [share_size(x, me) for x in mine_order], h.cross, transport, deadline)
    # 3. every local member's gathered shares, within the host
    sizes = [sum(share_size(x, k) for x in range(len(h.hosts))) for k in range(L)]
    every = np.empty(sum(sizes), np.uint8)
    shm_collectives.allgatherv(got, every, sizes, lshm, deadline)
    # 4. put each member's block in place
    outs = offsets([int(c) for c in counts])
    starts = offsets(sizes)
    for k in range(L):
        at = starts[k]
        for x in order(k):  # share k of host x: bytes [shares[x][k], shares[x][k+1])
            n = share_size(x, k)
            _scatter(every[at:at + n], shares[x][k], h.hosts[x], host_counts[x], index,
                     outs, dst)
            at += n


def _scatter(piece, start: int, members, member_counts, index, outs, dst) -> None:
    """Copy ``piece`` (bytes ``[start, start + len)`` of a host's blob, whose blocks are
    its members' in order) to where each member's bytes go in ``dst``."""
    block = 0
    pos = start
    end = start + piece.size
    bounds = offsets(member_counts)
    while pos < end:
        while bounds[block + 1] <= pos:
            block += 1
        take = min(end, bounds[block + 1]) - pos
        target = outs[index[members[block]]] + pos - bounds[block]
        dst[target:target + take] = piece[pos - start:pos - start + take]
        pos += take
