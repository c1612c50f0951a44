"""Which hosts an elastic job may use: the discovery script (or the fixed ``-H`` list),
and the hosts blacklisted after a failure.

The script is run without arguments and prints one host per line, ``host:slots`` or
``host`` (then ``--slots-per-host``, default 1, slots); blank lines and ``#`` comments
are skipped. A script that fails, hangs past :data:`SCRIPT_TIMEOUT_S` or prints a bad
line leaves the previous answer in force (and says why, once per distinct problem).
"""

from __future__ import annotations

import random
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

from ddl.core.errors import ConfigError

SCRIPT_TIMEOUT_S = 10.0


def parse(text: str, slots_per_host: int, source: str) -> Dict[str, int]:
    """``host -> slots``, in the order printed; ConfigError naming the bad line."""
    hosts: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots_text = line.rpartition(":")
        if not sep:
            name, slots_text = line, str(slots_per_host)
        try:
            slots = int(slots_text, 10)
        except ValueError:
            slots = 0
        if not name or slots < 1 or any(c.isspace() for c in name):
            raise ConfigError(f"{source} line {number}: {raw.strip()!r} is not host:slots "
                              f"(slots >= 1)", variable="DDL_HOST_DISCOVERY_SCRIPT",
                              value=raw.strip())
        hosts[name] = hosts.get(name, 0) + slots
    return hosts


class Discovery:
    """The current hosts: from ``script`` when given, else ``static``."""

    def __init__(self, script: str, slots_per_host: int,
                 static: Sequence[Tuple[str, int]] = ()):
        self.script = script
        self.slots_per_host = slots_per_host
        self._last: Dict[str, int] = dict(static)
        self.problem = ""  # the last failure of the script ("" once it works)

    @property
    def polled(self) -> bool:
        """Whether the hosts may change (the driver calls :meth:`find` every second)."""
        return bool(self.script)

    def find(self) -> Dict[str, int]:
        """Run the script (if any) and return the hosts; on a failure, the previous
        hosts, with :attr:`problem` saying what went wrong."""
        if not self.script:
            return dict(self._last)
        try:
            done = subprocess.run([self.script], capture_output=True, text=True,
                                  timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.problem = (f"--host-discovery-script {self.script} ran longer than "
                            f"{SCRIPT_TIMEOUT_S:g} s")
            return dict(self._last)
        except OSError as exc:
            self.problem = f"--host-discovery-script {self.script} cannot run: {exc}"
            return dict(self._last)
        if done.returncode != 0:
            self.problem = (f"--host-discovery-script {self.script} exited with code "
                            f"{done.returncode}: {done.stderr.strip()[:200]}")
            return dict(self._last)
        try:
            self._last = parse(done.stdout, self.slots_per_host,
                               f"--host-discovery-script {self.script}")
        except ConfigError as exc:
            self.problem = str(exc)
            return dict(self._last)
        self.problem = ""
        return dict(self._last)


class Blacklist:
    """Hosts a worker failed on get no new worker: for good without a cooldown range (as
    horovodrun), else for ``MIN`` seconds doubling per failure up to ``MAX`` (with a
    little jitter, so hosts that failed together do not come back together)."""

    def __init__(self, cooldown: Optional[Tuple[float, float]] = None):
        self.cooldown = cooldown
        self._failures: Dict[str, int] = {}
        self._until: Dict[str, float] = {}

    def fail(self, host: str, now: float) -> float:
        """Record a failure on ``host``; returns the seconds it is out (inf: for good)."""
        n = self._failures[host] = self._failures.get(host, 0) + 1
        if self.cooldown is None:
            self._until[host] = float("inf")
            return float("inf")
        low, high = self.cooldown
        seconds = min(high, low * 2 ** (n - 1)) * random.uniform(1.0, 1.1)
        self._until[host] = now + seconds
        return seconds

    def allowed(self, host: str, now: float) -> bool:
        return self._until.get(host, 0.0) <= now

    def hosts(self, now: float) -> List[str]:
        return sorted(h for h, t in self._until.items() if t > now)


def parse_cooldown(text: str) -> Optional[Tuple[float, float]]:
    """``"MIN MAX"`` (or ``MIN,MAX``) seconds -> (min, max); "" -> None."""
    if not text.strip():
        return None
    parts = text.replace(",", " ").split()
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        low = high = -1.0
    if len(parts) != 2 or not 0 < low <= high:
        raise ConfigError(f"--blacklist-cooldown-range {text!r}: expected two numbers of "
                          f"seconds, MIN MAX with 0 < MIN <= MAX",
                          variable="DDL_BLACKLIST_COOLDOWN_RANGE", value=text)
    return low, high
