"""Launching on several hosts: the part of :class:`ddl.launcher._job.Job` that starts
coordinators and workers on other hosts over ssh.

The first host's coordinator is the leader, every other host's relays to it. Remote
processes run through ``ssh HOST python -m ddl.launcher.remote`` (see
:mod:`ddl.launcher.remote`): the program, its environment and the job secret go on the
agent's standard input, which stays open for the job's lifetime. Before anything
starts, every remote host is reached over ssh (:func:`ddl.launcher._ssh.preflight`) and,
without ``--network-interface``, the hosts' addresses are probed
(:func:`ddl.launcher._probe.run`).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Dict, List, Optional, Tuple

from ddl.core import config as _config
from ddl.core import report as _report
from ddl.launcher import _probe, _ssh
from ddl.launcher._names import LaunchError, coordinator_index, who
from ddl.launcher._ssh import SshOptions


@dataclass(frozen=True)
class RemoteSettings:
    """How ddlrun reaches other hosts: ssh options, ``--network-interface`` names, and the
    extra variables to forward (``-x NAME``)."""

    ssh: SshOptions = field(default_factory=SshOptions)
    interfaces: Tuple[str, ...] = ()
    forward: Tuple[str, ...] = ()


def is_local(host: str) -> bool:
    from ddl.launcher._hosts import local_names
    return host in local_names()


def _ssh_bind(local_bind: str, remote: bool) -> str:
    """The leader's peer bind address: the agent's choice on a remote host, else ours."""
    return "{bind}" if remote else local_bind


class MultiHostLaunch:
    """Mixed into Job: ``_start_hosts`` and what it needs (uses Job's state and its
    ``_launch``, ``_start_coordinator``, ``_start_worker``, ``_check_start_events``)."""

    def _start_hosts(self, common: Dict[str, str], out: IO[str], err: IO[str]) -> None:
        """Coordinators (leader on the first host, relays elsewhere) and workers on every
        host: local ones directly, remote ones through ``ssh HOST python -m
        ddl.launcher.remote`` (see :mod:`ddl.launcher._ssh`)."""
        settings = self._remote
        remote_hosts = sorted({h for h, r in zip(self._hosts, self._is_remote) if r})
        self._log(f"checking that {', '.join(remote_hosts)} answer over ssh")
        unreachable, seen = _ssh.preflight(
            remote_hosts, settings.ssh, min(self._start_timeout, settings.ssh.connect_timeout))
        if unreachable:
            raise LaunchError("cannot reach " + "; ".join(
                f"host {h} over ssh ({why})" for h, why in sorted(unreachable.items())))
        local_bind = ""
        chosen: Dict[str, str] = {}
        if not settings.interfaces and len(self._hosts) > 1:
            local = [h for h, r in zip(self._hosts, self._is_remote) if not r]
            chosen, error = _probe.run(remote_hosts, local[0] if local else "", seen,
                                       settings.ssh, self._base_env, self._start_timeout)
            if error:
                raise LaunchError(error)
            for host in self._hosts:
                self._log(f"host {host} uses {chosen[host]} (every other host reached it)")
        if not all(self._is_remote):  # this host runs ranks too: where the others saw us
            local_name = self._hosts[self._is_remote.index(False)]
            local_bind = (_ssh.interface_address(settings.interfaces[0]) if settings.interfaces
                          else chosen.get(local_name) or seen.get(remote_hosts[0], ""))
            if not local_bind:
                raise LaunchError(f"cannot tell which address {remote_hosts[0]} reaches this "
                                  f"host on; give --network-interface")
            self._log(f"host {local_name} (this one) uses {local_bind}")
        self._addresses = chosen
        env = dict(common, DDL_SIZE=str(self.size))
        env.pop("DDL_REPORT_DIR", None)  # remote ranks cannot write into our directory
        base = [sys.executable, "-m", "ddl.server.daemon", "--size", str(self.size),
                "--start-timeout", repr(self._start_timeout)]
        addresses: List[str] = []
        peer = ""
        for node, host in enumerate(self._hosts):
            index = coordinator_index(node)
            role = (["--peer-address", f"{_ssh_bind(local_bind, self._is_remote[node])}:0"]
                    if node == 0 else
                    ["--leader", peer, "--local-size", str(self._nodes[node])])
            if self._is_remote[node]:
                argv = base + ["--address", "127.0.0.1:0", "--hostname", host] + role
                self._launch_remote(index, host, argv, env, {
                    "stderr": (f"[coordinator {host}]<stderr>:", err, None,
                               self._mute_coordinator)})
                bound = self._read_lines(index, 2 if node == 0 else 1)
            else:
                sock = os.path.join(self._tmpdir, f"coord{node}.sock")
                addr_file = os.path.join(self._tmpdir, f"coord{node}.addr")
                argv = base + ["--address", "unix:" + sock, "--hostname", host,
                               "--job-dir", self._tmpdir, "--address-file", addr_file] + role
                self._start_coordinator(node, argv, env, err)
                self._wait_for_file(addr_file, index)
                with open(addr_file) as f:
                    bound = f.read().split()
            addresses.append(bound[0])
            if node == 0:
                peer = bound[1]
                self._log(f"leader on host {host}, peers connect to {peer}")
        rank = 0
        for node, count in enumerate(self._nodes):
            host = self._hosts[node]
            for local_rank in range(count):
                if self._is_remote[node]:
                    wenv = dict(common)
                    wenv.pop("DDL_REPORT_DIR", None)  # the agent makes one there
                    wenv.update(_config.to_env({
                        "rank": rank, "size": self.size, "local_rank": local_rank,
                        "local_size": count, "coordinator_addr": addresses[node]}))
                    wenv["DDL_HOSTNAME"] = host
                    wenv.setdefault("DDL_BIND_ADDRESS", "{bind}")
                    files = self._open_rank_files(rank)
                    relayed = (lambda line, r=rank: _report.accept_relayed(
                        self._report_dir, r, line))
                    self._launch_remote(rank, host, self._argvs[rank], wenv, {
                        "stdout": (f"[{rank}]<stdout>:", out, files[0]),
                        "stderr": (f"[{rank}]<stderr>:", err, files[1], None, relayed)},
                        report_rank=rank)
                else:
                    wcommon = dict(common, DDL_BIND_ADDRESS=common.get("DDL_BIND_ADDRESS")
                                   or local_bind)
                    self._start_worker(rank, local_rank, count, addresses[node], host,
                                       wcommon, out, err)
                rank += 1

    def _launch_remote(self, index: int, host: str, argv: List[str], env: Dict[str, str],
                       streams, report_rank: Optional[int] = None) -> None:
        """Start ``argv`` on ``host`` through the ssh agent; ``env`` (the secret among it)
        goes on the agent's standard input, which stays open for the job's lifetime."""
        settings = self._remote
        forwarded = {k: v for k, v in env.items()
                     if k.startswith("DDL_") or k in ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED")
                     or k in settings.forward}
        forwarded.pop("DDL_LAUNCHER_PID", None)  # the agent is the remote parent
        spec = {"argv": list(argv), "env": forwarded, "cwd": os.getcwd(), "host": host,
                "interfaces": list(settings.interfaces), "verbose": self._verbose,
                "address": self._addresses.get(host, "")}
        if report_rank is not None:
            spec["report_rank"] = report_rank
        self._remote_indices.add(index)
        ssh_argv = settings.ssh.argv(host, _ssh.remote_agent_argv())
        local_env = {k: v for k, v in self._base_env.items() if k != "DDL_JOB_SECRET"}
        self._log(f"starting {who(index)} on {host}: {self._show(env, argv)}")
        self._launch(index, ssh_argv, local_env, (), subprocess.PIPE, False, streams)
        stdin = self._procs[index].stdin
        try:
            stdin.write(json.dumps(spec).encode() + b"\n")
            stdin.flush()
        except OSError:
            pass  # ssh already exited: its exit is reported as the failure
        self._stdins.append(stdin)

    def _read_lines(self, index: int, count: int) -> List[str]:
        """The first ``count`` lines a remote coordinator prints (its bound addresses);
        LaunchError if it exits, on a stop, or after the start timeout."""
        proc = self._procs[index]
        lines: "queue.SimpleQueue" = queue.SimpleQueue()

        def read() -> None:
            got = []
            for raw in iter(proc.stdout.readline, b""):
                got.append(raw.decode(errors="replace").strip())
                if len(got) == count:
                    break
            lines.put(got)
        threading.Thread(target=read, daemon=True, name=f"ddlrun-addr {who(index)}").start()
        deadline = time.monotonic() + self._start_timeout
        while True:
            try:
                got = lines.get(timeout=0.02)
            except queue.Empty:
                got = None
            if got is not None and len(got) == count:
                self._forwarder.add(proc.stdout, f"[coordinator {-1 - index}]<stdout>:",
                                    (self._stderr or sys.stderr) if self._verbose else None,
                                    None)
                return got
            if time.monotonic() > deadline:
                raise LaunchError(f"{who(index)} did not report its address within "
                                  f"{self._start_timeout:g} s (--start-timeout)")
            self._check_start_events(index, 0.0)
