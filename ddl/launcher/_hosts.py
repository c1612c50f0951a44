"""Parse ``-H host:slots,...`` and check that every host is this machine.

Launching on other hosts needs ssh support, which is not there yet; until then a remote
host is an error that says so.
"""

from __future__ import annotations

import socket
from typing import List, Tuple

from ddl._errors import ConfigError


def parse_hosts(text: str, flag: str = "-H") -> List[Tuple[str, int]]:
    """``"a:2,b"`` -> ``[("a", 2), ("b", 1)]``; a host without ``:slots`` has one slot."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ConfigError(f"{flag} {text!r}: empty host entry; expected host:slots,...",
                              variable="DDL_HOSTS", value=text)
        name, sep, slots_text = item.rpartition(":")
        if not sep:
            name, slots_text = item, "1"
        try:
            slots = int(slots_text, 10)
        except ValueError:
            slots = 0
        if not name or slots < 1:
            raise ConfigError(f"{flag} {text!r}: bad entry {item!r}; expected host:slots with "
                              f"slots >= 1", variable="DDL_HOSTS", value=text)
        hosts.append((name, slots))
    return hosts


def local_names() -> set:
    names = {"localhost", "127.0.0.1", "::1"}
    hostname = socket.gethostname()
    if hostname:
        names.update({hostname, hostname.split(".")[0]})
    return names


def local_slots(text: str, np: int, flag: str = "-H") -> int:
    """Total slots of ``text`` after checking that all hosts are local and there are enough."""
    hosts = parse_hosts(text, flag)
    known = local_names()
    remote = [h for h, _ in hosts if h not in known]
    if remote:
        raise ConfigError(
            f"{flag} names {', '.join(remote)}, which is not this machine; ddlrun can only "
            f"launch on this host for now (multi-host launching comes with ssh support)",
            variable="DDL_HOSTS", value=text)
    total = sum(s for _, s in hosts)
    if total < np:
        raise ConfigError(f"{flag} {text!r} has {total} slot(s) but -np is {np}; give every "
                          f"process a slot, e.g. -H localhost:{np}",
                          variable="DDL_HOSTS", value=text)
    return total
