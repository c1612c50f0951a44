"""Which address each host of a job can be reached on by every other host.

Every host of the job runs a probe at once (the remote ones through ssh, ``python -m
ddl.launcher.remote probe``; ddlrun's own host in-process, when it runs ranks). A probe
listens on every IPv4 address of its host and reports ``{address: port}``; ddlrun sends
each probe everyone else's list; each probe tries a TCP connection to each of them and
reports which answered. For every host ddlrun then takes the first of its addresses, in
preference order (the one ssh reached first), that every other host reached, and logs
the choice. A host that some other host cannot reach on any address is an error naming
both. Messages are JSON lines; a probe exits when its standard input closes.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, IO, List, Mapping, Optional, Sequence, Tuple

CONNECT_TIMEOUT_S = 2.0


def local_addresses() -> List[str]:
    """This host's IPv4 addresses, loopback excluded, in interface order."""
    from ddl.launcher._ssh import interface_address
    found: List[str] = []
    for _, name in socket.if_nameindex():
        try:
            address = interface_address(name)
        except ValueError:
            continue
        if not address.startswith("127.") and address not in found:
            found.append(address)
    return found


def interface_of(address: str) -> Optional[str]:
    """The name of this host's network interface that holds IPv4 ``address``, or None."""
    from ddl.launcher._ssh import interface_address
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except ValueError:
            continue
    return None


class Listeners:
    """A listening socket on each address (accepted connections are closed at once)."""

    def __init__(self, addresses: Sequence[str]):
        self.ports: Dict[str, int] = {}
        self._socks: List[socket.socket] = []
        for address in addresses:
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((address, 0))
                s.listen(64)
            except OSError:
                continue
            self._socks.append(s)
            self.ports[address] = s.getsockname()[1]
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    @staticmethod
    def _accept(s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def connects(targets: Dict[str, Dict[str, int]],
             timeout: float = CONNECT_TIMEOUT_S) -> Dict[str, List[str]]:
    """``{host: [addresses that accepted a TCP connection]}`` for ``{host: {address:
    port}}``, all tried at once."""
    out: Dict[str, List[str]] = {h: [] for h in targets}
    lock = threading.Lock()

    def one(host: str, address: str, port: int) -> None:
        try:
            socket.create_connection((address, port), timeout=timeout).close()
        except OSError:
            return
        with lock:
            out[host].append(address)

    threads = [threading.Thread(target=one, args=(h, a, p), daemon=True)
               for h, ports in targets.items() for a, p in ports.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)
    return out


def serve(stdin: IO[bytes], stdout: IO[bytes], preferred: Sequence[str] = ()) -> None:
    """The probe's side: print our ``{address: port}``, read the targets, print what we
    reached, then wait for standard input to close."""
    addresses = list(dict.fromkeys(list(preferred) + local_addresses()))
    listeners = Listeners(addresses)
    try:
        _send(stdout, {"ports": listeners.ports})
        line = stdin.readline()
        if not line:
            return
        targets = json.loads(line)["targets"]
        _send(stdout, {"reached": connects(targets)})
        while stdin.readline():  # until ddlrun closes our standard input
            pass
    finally:
        listeners.close()


def _send(stdout: IO[bytes], obj) -> None:
    stdout.write(json.dumps(obj).encode() + b"\n")
    stdout.flush()


def choose(order: Dict[str, List[str]], reached: Dict[str, Dict[str, List[str]]]
           ) -> Tuple[Dict[str, str], Optional[str]]:
    """``({host: address}, error)``: for each host the first address of ``order[host]``
    that every other host reached (``reached[prober][host]``), or an error naming a host
    and who cannot reach it."""
    chosen: Dict[str, str] = {}
    for host, addresses in order.items():
        others = [p for p in reached if p != host]
        good = [a for a in addresses if all(a in reached[p].get(host, []) for p in others)]
        if not good:
            blind = [p for p in others if not reached[p].get(host)]
            who = ", ".join(blind or others)
            return chosen, (f"host {host} cannot be reached from {who} on any of its "
                            f"addresses ({', '.join(addresses) or 'none'}); give "
                            f"--network-interface, or check the network between them")
        chosen[host] = good[0]
    return chosen, None


def run(remote_hosts: Sequence[str], local_host: str, seen: Mapping[str, str], ssh,
        environ: Mapping[str, str], timeout: float) -> Tuple[Dict[str, str], Optional[str]]:
    """Probe every host of a job at once; ``({host: address}, error)``. ``local_host``:
    this host's name in the job when it runs ranks (else ""); ``seen``: the address each
    remote host saw this host connect from (preferred for this host)."""
    from ddl.launcher._ssh import remote_agent_argv
    deadline = time.monotonic() + timeout
    lines: "queue.SimpleQueue" = queue.SimpleQueue()
    procs: Dict[str, subprocess.Popen] = {}
    listeners = None
    env = {k: v for k, v in environ.items() if k != "DDL_JOB_SECRET"}
    try:
        for host in remote_hosts:
            procs[host] = subprocess.Popen(ssh.argv(host, remote_agent_argv() + ["probe"]),
                                           env=env, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            threading.Thread(target=_read_into, args=(host, procs[host].stdout, lines),
                             daemon=True).start()
        ports: Dict[str, Dict[str, int]] = {}
        if local_host:
            first = [seen[remote_hosts[0]]] if seen.get(remote_hosts[0]) else []
            listeners = Listeners(list(dict.fromkeys(first + local_addresses())))
            ports[local_host] = listeners.ports
        got, error = _collect(lines, set(procs), "ports", deadline, timeout)
        if error:
            return {}, error
        ports.update(got)
        for host, proc in procs.items():
            proc.stdin.write(json.dumps({"targets": {
                h: p for h, p in ports.items() if h != host}}).encode() + b"\n")
            proc.stdin.flush()
        reached = ({local_host: connects({h: p for h, p in ports.items() if h != local_host})}
                   if local_host else {})
        got, error = _collect(lines, set(procs), "reached", deadline, timeout)
        if error:
            return {}, error
        reached.update(got)
        return choose({h: list(p) for h, p in ports.items()}, reached)
    except OSError as exc:
        return {}, f"the network probe failed: {exc.strerror or exc}"
    finally:
        if listeners is not None:
            listeners.close()
        for proc in procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _read_into(host: str, pipe: IO[bytes], lines: "queue.SimpleQueue") -> None:
    for raw in iter(pipe.readline, b""):
        lines.put((host, raw))
    lines.put((host, None))


def _collect(lines: "queue.SimpleQueue", hosts: set, key: str, deadline: float,
             timeout: float) -> Tuple[Dict[str, dict], Optional[str]]:
    """Each probe's next message's ``key``, by the deadline; or an error naming hosts."""
    got: Dict[str, dict] = {}
    while len(got) < len(hosts):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = ", ".join(sorted(hosts - set(got)))
            return got, f"the network probe on {missing} did not answer within {timeout:g} s"
        try:
            host, raw = lines.get(timeout=min(0.05, remaining))
        except queue.Empty:
            continue
        if raw is None:
            return got, (f"the network probe on host {host} ended early (is ddl installed "
                         f"there, for {sys.executable}?)")
        try:
            got[host] = json.loads(raw)[key]
        except (ValueError, KeyError, TypeError):
            return got, f"the network probe on host {host} answered {raw[:80]!r}"
    return got, None
