"""The coordinator a size-1 job runs inside its own process (``python train.py`` alone).

No launcher started a daemon, so the worker serves the coordinator itself on a private
unix socket; :meth:`close` stops it and removes the socket's directory. Only this start
path imports the server package.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Optional


class EmbeddedCoordinator:
    """A one-rank job's coordinator, served on a private unix socket in this process."""

    def __init__(self, config: Any, job_id: str, secret: str):
        from ddl.server import CoordinatorServer  # only a size-1 job embeds the server

        self._dir: Optional[str] = tempfile.mkdtemp(prefix="ddl-")  # mode 0700
        self._server: Any = CoordinatorServer(
            job_id=job_id, secret_hex=secret, size=1,
            address=f"unix:{os.path.join(self._dir, 'coord.sock')}",
            fusion_threshold=config.fusion_threshold,
            stall_check_time=config.stall_check_time,
            stall_shutdown_time=config.stall_shutdown_time,
            start_timeout=config.start_timeout,
            heartbeat_interval=config.heartbeat_interval,
            liveness_timeout=config.liveness_timeout)
        self.address: str = self._server.start()

    def close(self) -> None:
        """Stop the server and remove its directory; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
