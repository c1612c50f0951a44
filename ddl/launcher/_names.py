"""How ddlrun numbers the processes of a job and names them in its messages, and the
error it raises when a job cannot start. Shared by the local start
(:mod:`ddl.launcher._job`) and the start on other hosts (:mod:`ddl.launcher._multihost`).

A process's index in the launcher's events and return codes: a rank is its rank (>= 0);
node ``n``'s coordinator is ``-1 - n`` (the leader's, on node 0, is ``COORDINATOR``).
"""

from __future__ import annotations

from ddl.core.errors import DDLError

COORDINATOR = -1  # index of the coordinator in events and return codes


class LaunchError(DDLError):
    """The job could not be started (e.g. the coordinator never became ready)."""


def coordinator_index(node: int) -> int:
    """Index of node ``node``'s coordinator in events and return codes (-1, -2, ...)."""
    return -1 - node


def who(index: int) -> str:
    """The process with launcher index ``index``, as messages name it."""
    if index == COORDINATOR:
        return "the coordinator"
    return f"the coordinator of node {-1 - index}" if index < 0 else f"rank {index}"
