"""What the leader keeps per name in flight (:class:`Pending`), per failed round of a
name (:class:`Failed`), and per rank (:class:`Peer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Set, Tuple

from ddl.core.dtypes import op_name
from ddl.v1 import coordinator_pb2 as pb

Delivery = Tuple[int, pb.CoordinatorMessage]
PendingKey = tuple  # (process_set_id, name) or ("add", name, members)


@dataclass
class Pending:
    """One name some ranks submitted and others have not yet."""

    name: str
    op: int
    process_set_id: int
    members: Tuple[int, ...]  # the set's members, or the listed members of ADD_PROCESS_SET
    since: float  # first arrival, clock seconds
    requests: Dict[int, pb.Request] = field(default_factory=dict)
    arrived: Dict[int, float] = field(default_factory=dict)  # rank -> clock seconds
    # ranks outside the set that wait to learn its id (add) or its end (remove): told the
    # outcome with the members, never required (see ProcessSets._watch)
    watchers: Dict[int, pb.Request] = field(default_factory=dict)
    warned: bool = False

    def describe(self) -> str:
        if self.op == pb.ADD_PROCESS_SET:
            return f"add_process_set '{self.name}' for ranks {list(self.members)}"
        return f"{op_name(self.op)} '{self.name}' in process set {self.process_set_id}"


@dataclass
class Failed:
    """One round of a name that a rank's local error failed: the error, and the members
    that have not submitted the name yet (each gets the error when it does)."""

    error: pb.Error
    owed: Set[int]


@dataclass(frozen=True)
class Peer:
    """Identity of a rank, for messages."""

    host: str = "?"
    pid: int = 0
