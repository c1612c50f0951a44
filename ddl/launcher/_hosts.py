"""Hosts and slots: ``-H host:slots,...`` or ``--hostfile``, and which hosts are this one.

Ranks fill the hosts in the order given (``-H a:2,b:2 -np 3`` puts ranks 0 and 1 on a,
rank 2 on b). A host that names this machine (``localhost``, its hostname, 127.0.0.1)
runs its ranks directly; any other is reached over ssh (:mod:`ddl.launcher._ssh`).
"""

from __future__ import annotations

import socket
from typing import List, Tuple

from ddl.core.errors import ConfigError


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


def parse_hostfile(path: str) -> List[Tuple[str, int]]:
    """Lines of ``host slots=N`` (or ``host:N``, or ``host``: one slot); ``#`` comments."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: {exc.strerror or exc}", variable="DDL_HOSTFILE",
                          value=path) from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        words = text.split()
        entry = words[0]
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "max_slots", "max-slots") and value:
                if key == "slots":
                    entry = f"{words[0]}:{value}"
            else:
                raise ConfigError(f"--hostfile {path} line {number}: {line.strip()!r}: "
                                  f"expected 'host slots=N'", variable="DDL_HOSTFILE",
                                  value=path)
        hosts += parse_hosts(entry, f"--hostfile {path} line {number}:")
    if not hosts:
        raise ConfigError(f"--hostfile {path} names no host", variable="DDL_HOSTFILE",
                          value=path)
    return hosts


def assign(hosts: List[Tuple[str, int]], np: int, flag: str = "-H") -> List[Tuple[str, int]]:
    """``(host, ranks)`` for ``np`` ranks filling ``hosts`` in order (hosts left without a
    rank are dropped); ConfigError when the slots are too few."""
    total = sum(s for _, s in hosts)
    if total < np:
        raise ConfigError(f"{flag} has {total} slot(s) but -np is {np}; give every process "
                          f"a slot", variable="DDL_HOSTS", value=str(hosts))
    out, left = [], np
    for host, slots in hosts:
        take = min(slots, left)
        if take:
            out.append((host, take))
        left -= take
    merged: List[Tuple[str, int]] = []
    for host, n in out:  # the same host twice runs one coordinator
        for i, (h, m) in enumerate(merged):
            if h == host:
                merged[i] = (h, m + n)
                break
        else:
            merged.append((host, n))
    return merged
