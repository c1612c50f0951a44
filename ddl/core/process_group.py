"""Signalling a child's whole process group: the one way ddl stops what a child started.

ddl starts its children (ranks, coordinator daemons, the remote side of a multi-host job)
with ``start_new_session=True``, so each leads a process group holding everything it
started; one ``killpg`` reaches them all, grandchildren included.
"""

from __future__ import annotations

import os
import signal
import subprocess


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the process group ``proc`` leads (it was started with
    ``start_new_session=True``); a group that is already gone is fine."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop what ``proc`` leads: SIGTERM to its group; SIGKILL if ``proc`` has not exited
    ``grace_s`` later; return once it is reaped (or, should even SIGKILL not end it, a
    process stuck in the kernel, ``grace_s`` after that)."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
