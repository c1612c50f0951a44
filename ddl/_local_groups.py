"""Which data path carries a collective: shared memory within a host, TCP otherwise.

:class:`LocalGroups` hands the executor a connected
:class:`~ddl.transports.shm.ShmGroup` for a collective whose members all run on this
host (same host name), or None (then the TCP transport carries it). Groups are made on
first use, one per member set, while every member executes the same response, so they
all connect at the same point of the global order. ``DDL_TRANSPORT`` forces the choice:
``auto`` (shared memory when it can), ``shm`` (an error where it cannot), ``tcp``.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable, Dict, Mapping, Optional, Tuple

from ddl._errors import ConfigError
from ddl.transports.base import Group

_SLOT_BYTES = 1 << 20  # per rank and bank: the chunk one rank moves per round


class LocalGroups:
    """Shared-memory groups of this rank, by member ranks."""

    def __init__(self, mode: str, job_id: str, secret: bytes, rank: int,
                 hosts: Mapping[int, str], abort_check: Callable[[], None],
                 tag_prefix: str = "g"):
        self.mode = mode
        self._tag_prefix = tag_prefix  # a second set of groups (the cycles') gets its own
        self._job_id = job_id
        self._secret = secret
        self._rank = rank
        self._hosts = dict(hosts)
        self._abort_check = abort_check
        self._groups: Dict[Tuple[int, ...], object] = {}
        self._lock = threading.Lock()
        self._available: Optional[bool] = None

    def _shm_possible(self) -> bool:
        if self._available is None:
            from ddl.transports import shm
            self._available = shm.available()
        return self._available

    def get(self, group: Group, deadline: float):
        """The connected shared-memory group for ``group``, or None for TCP."""
        if self.mode == "tcp" or group.size < 2:
            return None
        host = self._hosts.get(self._rank)
        if any(self._hosts.get(r) != host for r in group.ranks):
            if self.mode == "shm" and len(set(self._hosts.values())) == 1:
                raise ConfigError("DDL_TRANSPORT=shm but the members of this collective are "
                                  "on different hosts", variable="DDL_TRANSPORT", value="shm")
            return None
        if not self._shm_possible():
            if self.mode == "shm":
                raise ConfigError("DDL_TRANSPORT=shm but shared memory is not available on "
                                  "this machine (Linux futexes and /dev/shm are needed)",
                                  variable="DDL_TRANSPORT", value="shm")
            return None
        with self._lock:
            found = self._groups.get(group.ranks)
        if found is not None:
            return found
        from ddl.transports.shm import ShmGroup

        tag = self._tag_prefix + hashlib.sha256(repr(group.ranks).encode()).hexdigest()[:16]
        made = ShmGroup(self._job_id, self._secret, host or "", group.index, group.size,
                        _SLOT_BYTES, self._abort_check, tag=tag,
                        ranks=group.ranks).connect(deadline)
        with self._lock:
            self._groups[group.ranks] = made
        return made

    def hierarchy(self, group: Group):
        """The :class:`~ddl.collectives.hierarchical.Hierarchy` of ``group``: this rank's
        host mates, the members with this rank's position on every host, and every
        host's members. None
        when shared memory is off, ``group`` sits on one host, or its hosts hold different
        numbers of members (or one each: nothing to gain)."""
        if self.mode == "tcp" or not self._shm_possible():
            return None
        by_host: Dict[str, list] = {}
        for r in group.ranks:
            by_host.setdefault(self._hosts.get(r, ""), []).append(r)
        sizes = {len(members) for members in by_host.values()}
        if len(by_host) < 2 or len(sizes) != 1 or sizes == {1}:
            return None
        from ddl.collectives.hierarchical import Hierarchy
        mine = by_host[self._hosts.get(self._rank, "")]
        position = mine.index(self._rank)
        cross = [members[position] for members in by_host.values()]
        hosts = tuple(sorted(tuple(sorted(m)) for m in by_host.values()))
        return Hierarchy(Group.of(mine, self._rank), Group.of(cross, self._rank), hosts)

    def close(self) -> None:
        """Leave every group (idempotent)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for g in groups:
            g.close()  # type: ignore[attr-defined]


class FixedGroup:
    """Every collective on one given shared-memory group (the cache cycles' own)."""

    def __init__(self, group):
        self.group = group

    def get(self, group: Group, deadline: float):
        return self.group

    def close(self) -> None:
        self.group.close()
