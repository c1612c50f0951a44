"""The ddl coordinator: the leader's negotiation logic and its gRPC server.

``CoordinatorServer`` runs embedded (a size-1 job, tests) or inside the
``ddl-coordinator`` daemon (:mod:`ddl.server.daemon`).
"""

from .coordinator import CoordinatorServer as CoordinatorServer

__all__ = ["CoordinatorServer"]
