"""How many CPUs this process may run on (its affinity where the OS has one)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one, else
    the machine's count (at least 1). Ranks of a host compare it with their number to
    decide whether they may spin, or run a background thread, without taking a CPU from
    one another."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)
