"""Transports: byte movement between ranks. See :mod:`ddl.dataplane.transports.base`.

Which data path carries a collective is chosen in :mod:`ddl.dataplane.backends`, not here.
"""

from ddl.dataplane.transports.base import AbortCheck, Group, Transport
from ddl.dataplane.transports.tcp import TcpTransport

__all__ = ["AbortCheck", "Group", "Transport", "TcpTransport"]
