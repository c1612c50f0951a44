"""Transports: byte movement between ranks. See :mod:`ddl.transports.base`.

Which data path carries a collective is chosen in :mod:`ddl.backends`, not here.
"""

from ddl.transports.base import AbortCheck, Group, Transport
from ddl.transports.tcp import TcpTransport

__all__ = ["AbortCheck", "Group", "Transport", "TcpTransport"]
