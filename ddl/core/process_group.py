"""Signalling a child's whole process group: the one way ddl stops what a child started.

ddl starts its children (ranks, coordinator daemons, the remote side of a multi-host job)
with ``start_new_session=True``, so each leads a process group holding everything it
started; one ``killpg`` reaches them all, grandchildren included.
"""

from __future__ import annotations

import os
import subprocess


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the process group ``proc`` leads (it was started with
    ``start_new_session=True``); a group that is already gone is fine."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
