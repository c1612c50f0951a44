"""Transports: byte movement between ranks. See :mod:`ddl.transports.base`.

``ORDER`` lists transport classes by preference; the runtime carries a collective on the
first instance whose ``supports(group)`` is true. TCP supports every group, so it is last.
"""

from ddl.transports.base import AbortCheck, Group, Transport
from ddl.transports.tcp import TcpTransport

ORDER = (TcpTransport,)

__all__ = ["AbortCheck", "Group", "Transport", "TcpTransport", "ORDER"]
