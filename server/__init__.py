"""The ddl coordinator: the leader's negotiation logic and its gRPC servers.

``CoordinatorServer`` is the leader (node 0); it runs embedded (a size-1 job, tests) or
inside the ``ddl-coordinator`` daemon (:mod:`ddl.server.daemon`). ``RelayServer`` is the
coordinator of every other node: it relays its workers to the leader over one
``PeerLink`` stream.
"""

from .coordinator import CoordinatorServer as CoordinatorServer
from .relay import RelayServer as RelayServer

__all__ = ["CoordinatorServer", "RelayServer"]
