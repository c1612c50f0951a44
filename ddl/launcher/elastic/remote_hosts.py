"""Workers on other hosts, the part of :class:`~ddl.launcher.elastic.driver.ElasticJob`
that reaches them over ssh.

A remote worker runs through ``ssh HOST python -m ddl.launcher.remote`` (see
:mod:`ddl.launcher.remote`): its program and environment, the job secret among it, go on
the agent's standard input, never on a command line, and ``DDL_ELASTIC_ADDR`` holds the
``{launcher}`` placeholder that the agent fills with the address ddlrun's ssh came from.
Every second ddlrun writes a byte to each agent, which stops its worker after
:data:`HEARTBEAT_TIMEOUT_S` without one (a host cut off). Hosts found by discovery are
probed as the fixed launcher probes them (:mod:`ddl.launcher._probe`), and each world's
``assign`` carries the address its hosts reach each other on.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Dict

from ddl.core.errors import ConfigError
from ddl.launcher import _probe, _ssh
from ddl.launcher._multihost import is_local
from ddl.launcher._spawn import spawn

HEARTBEAT_S = 1.0  # a byte to every remote worker's agent this often ...
HEARTBEAT_TIMEOUT_S = 10.0  # ... which stops its worker after this long without one


class RemoteHosts:
    """Mixed into ElasticJob (uses its ``_remote``, ``_workers``, ``_addresses``,
    ``_probed``, ``_probe_problem``, ``_starter``, ``command``, ``start_timeout``,
    ``_verbose``, ``_closing`` and ``_log``)."""

    def _interface_address(self) -> str:
        """This host's address on the first ``--network-interface`` it has ("" if none:
        then a world spanning hosts binds every address, as without the flag)."""
        for name in self._remote.interfaces:
            try:
                return _ssh.interface_address(name)
            except ConfigError:
                continue
        self._log(f"warning: this host has none of the interfaces "
                  f"{', '.join(self._remote.interfaces)} (--network-interface); its workers "
                  f"bind every address")
        return ""

    def _spawn_remote(self, host: str, env: Dict[str, str], index: int):
        settings = self._remote
        forwarded = {k: v for k, v in env.items()
                     if k.startswith("DDL_") or k in ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED")
                     or k in settings.forward}
        forwarded.pop("DDL_LAUNCHER_PID", None)
        forwarded.setdefault("DDL_BIND_ADDRESS", "{bind}")
        spec = {"argv": self.command, "env": forwarded, "cwd": os.getcwd(), "host": host,
                "interfaces": list(settings.interfaces), "verbose": self._verbose,
                "heartbeat_timeout": HEARTBEAT_TIMEOUT_S,
                "address": self._addresses.get(host, "")}  # each world's assign may change it
        ssh_argv = settings.ssh.argv(host, _ssh.remote_agent_argv())
        local_env = {k: v for k, v in os.environ.items() if k != "DDL_JOB_SECRET"}
        proc = spawn(ssh_argv, local_env, stdin=subprocess.PIPE)
        try:
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # ssh already exited: reaped as a failure
        return proc, proc.stdin

    def _probe(self, hosts: Dict[str, int]) -> tuple:
        """``(hosts, {host: address})``: the address each host's workers bind, found as
        the fixed launcher finds it (:mod:`ddl.launcher._probe`: every host tries every
        other's addresses) for the hosts not probed yet together with those that run
        workers, whenever they span hosts and one is remote. The addresses ride on each
        world's ``assign`` (so a host's workers bind the address that the hosts of their
        current world reach). A host whose probe fails is left out of ``hosts`` (and
        probed again at the next discovery). Without a probe (``--network-interface``, or
        one host) the agent's own choice stands (see :mod:`ddl.launcher.remote`)."""
        new = [h for h in hosts if h not in self._probed]
        if self._remote.interfaces or not new or self._starter is not None:
            return hosts, {}
        busy = {w.host for w in list(self._workers.values()) if w.live}
        group = list(dict.fromkeys(new + [h for h in hosts if h in busy]))
        local = [h for h in group if is_local(h)]
        remote = [h for h in group if h not in local]
        if not remote or len(group) < 2:
            return hosts, {}
        chosen, error = _probe.run(remote, local[0] if local else "", {}, self._remote.ssh,
                                   dict(os.environ), min(self.start_timeout, 30.0))
        if error:
            if error != self._probe_problem:
                self._log(f"warning: {error}; no worker starts on {', '.join(new)} until "
                          f"the hosts' addresses are probed")
            self._probe_problem = error
            return {h: n for h, n in hosts.items() if h not in new}, {}
        self._probe_problem = ""
        for host in local[1:]:
            chosen[host] = chosen[local[0]]
        for host in group:
            self._log(f"host {host} uses {chosen[host]} (every other host reached it)")
        self._probed.update(group)
        return hosts, chosen

    def _heartbeat(self) -> None:
        """A byte to every remote worker's agent each second: its proof that ddlrun and
        the link to it are alive (see :mod:`ddl.launcher.remote`)."""
        while not self._closing.wait(HEARTBEAT_S):
            for w in list(self._workers.values()):
                stdin = w.stdin
                if stdin is None or w.returncode is not None:
                    continue
                try:
                    stdin.write(b"\n")
                    stdin.flush()
                except (OSError, ValueError):
                    pass  # ssh exited, or we closed its standard input: it is being stopped
