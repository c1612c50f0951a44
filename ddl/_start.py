"""What start-up hands the runtime: the job's configuration and what this rank owns.

Written by :mod:`ddl._bootstrap` (and :mod:`ddl._node_rendezvous`, which it calls),
read by :class:`ddl._runtime.Runtime`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ddl import _config
from ddl._local_coordinator import LocalCoordinator
from ddl._mpi import MpiState


@dataclass
class Start:
    """What :class:`ddl._runtime.Runtime` needs beyond the configuration."""

    config: _config.Config
    coordinator: Optional[LocalCoordinator] = None  # a daemon this rank owns
    mpi: Optional[MpiState] = None
    cleanup: Any = None  # a callable run at shutdown (e.g. the node rendezvous's files)
