"""What start-up hands the runtime: the job's configuration and what this rank owns.

Written by :mod:`ddl.startup.bootstrap` (and :mod:`ddl.startup.rendezvous`, which it calls),
read by :class:`ddl.runtime.runtime.Runtime`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ddl.core import config as _config
from ddl.startup.coordinator import LocalCoordinator
from ddl.startup.mpi import MpiState


@dataclass
class Start:
    """What :class:`ddl.runtime.runtime.Runtime` needs beyond the configuration."""

    config: _config.Config
    coordinator: Optional[LocalCoordinator] = None  # a daemon this rank owns
    mpi: Optional[MpiState] = None
    cleanup: Any = None  # a callable run at shutdown (e.g. the node rendezvous's files)
