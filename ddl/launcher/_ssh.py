"""Reaching other hosts: the ssh command line, the pre-flight check, address choice.

Every remote process is ``ssh [options] HOST -- PYTHON -m ddl.launcher.remote``: the
remote command is a fixed argument list (quoted with ``shlex.join`` for the remote
shell); what to run, its environment (the job secret among it) and its directory travel
as one JSON line on ssh's standard input (:mod:`ddl.launcher.remote`), never on a
command line. ``DDL_SSH_COMMAND`` replaces ``ssh`` (e.g. ``ssh -F my_config``).
"""

from __future__ import annotations

import fcntl
import shlex
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ddl.core.errors import ConfigError

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class SshOptions:
    command: str = "ssh"  # DDL_SSH_COMMAND: the program and options of its own
    port: Optional[int] = None
    identity_file: str = ""
    connect_timeout: float = 10.0

    def argv(self, host: str, remote_argv: Sequence[str]) -> List[str]:
        """``ssh ... host -- 'remote argv, quoted'`` (no terminal, never a password)."""
        try:
            base = shlex.split(self.command)
        except ValueError as exc:
            raise ConfigError(f"DDL_SSH_COMMAND {self.command!r} cannot be split: {exc}",
                              variable="DDL_SSH_COMMAND", value=self.command) from None
        # a host that stops answering ends the connection within 15 s
        argv = base + ["-T", "-o", "BatchMode=yes", "-o",
                       f"ConnectTimeout={max(1, int(self.connect_timeout))}",
                       "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file]
        return argv + [host, "--", shlex.join(list(remote_argv))]


def remote_agent_argv(python: str = sys.executable) -> List[str]:
    """The fixed remote command: the agent reads everything else from standard input."""
    return [python, "-m", "ddl.launcher.remote"]


def preflight(hosts: Sequence[str], options: SshOptions,
              timeout: float) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Reach every host over ssh, at once. Returns ``({host: why}, {host: address})``:
    why each unreachable host could not be reached within ``timeout`` seconds, and for
    the others the address this host's connection came from as they saw it (the
    address they can reach this host on)."""
    failures: Dict[str, str] = {}
    seen: Dict[str, str] = {}
    lock = threading.Lock()

    def probe(host: str) -> None:
        try:
            r = subprocess.run(options.argv(host, ["sh", "-c", "echo $SSH_CONNECTION"]),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=timeout)
            why = "" if r.returncode == 0 else (
                (r.stderr.strip().splitlines() or [f"ssh exited with code {r.returncode}"])[-1])
            words = r.stdout.split()
            if not why and words:
                with lock:
                    seen[host] = words[0]
        except subprocess.TimeoutExpired:
            why = f"no answer within {timeout:g} s"
        except OSError as exc:
            why = f"cannot run ssh: {exc.strerror or exc}"
        if why:
            with lock:
                failures[host] = why

    threads = [threading.Thread(target=probe, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    for host, t in zip(hosts, threads):
        if t.is_alive():
            failures.setdefault(host, f"no answer within {timeout:g} s")
    return failures, seen


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this host; ConfigError if none."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                             struct.pack("256s", name.encode()[:15]))
    except OSError as exc:
        raise ConfigError(f"--network-interface {name}: no IPv4 address on this host "
                          f"({exc.strerror or exc})", variable="DDL_NETWORK_INTERFACE",
                          value=name) from None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def route_source(destination: str) -> str:
    """The address this host sends from to reach ``destination`` (an IP address; no
    packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((destination, 9))
        return s.getsockname()[0]
    finally:
        s.close()
