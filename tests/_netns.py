"""Test hosts on one machine: Linux network namespaces joined by a bridge, each with its
own address and its own sshd.

``TestHosts(n)`` makes namespaces ``ddlh<i>`` (address ``10.<net>.0.<i>``) behind a bridge
that also carries this (the root) namespace's address ``.254``; the first host also has
a management link to the root namespace only (``10.<net+1>.0.1``), which is where ssh
reaches it, so a job must find the address the hosts reach each other on. It generates
a host key and
a user key for this run, starts ``sshd`` in every namespace on its address, and writes an
ssh config (``Host ddlh1`` -> ``HostName 10.77.<net>.1``) with a generated known_hosts
file and ``StrictHostKeyChecking yes``. ``ssh_command`` is the value for
``DDL_SSH_COMMAND``. ``close()`` stops the sshds and deletes the namespaces and links.
Needs root, iproute2 and openssh-server; :func:`unavailable` says why not, if not.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from typing import List, Optional

SSHD = "/usr/sbin/sshd"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30,
                          check=check)


def unavailable() -> Optional[str]:
    """Why test hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 openssh-client)"
    if not os.path.exists(SSHD):
        return "sshd is not installed (apt-get install openssh-server)"
    # a name of this process's own: every pytest-xdist worker probes as it collects
    probe = f"ddlprobe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


LOCK_FILE = "/run/ddl-test-hosts.lock"
LOCK_WAIT_S = 300.0


class TestHosts:
    """``n`` hosts named ``ddlh1``..``ddlh<n>``; see the module doc."""

    def __init__(self, n: int, workdir: str, net: int = 77):
        self.names: List[str] = [f"ddlh{i}" for i in range(1, n + 1)]
        self.addresses = [f"10.{net}.0.{i}" for i in range(1, n + 1)]
        self.bridge = f"ddlbr{net}"
        # the first host also has a management link to this namespace only
        # (10.<net+1>.0.1); ssh reaches it there, and the other hosts cannot
        self.management = f"10.{net + 1}.0.1"
        self._mgmt_link = f"ddlm1n{net}"
        self.dir = workdir
        self._sshd: List[subprocess.Popen] = []
        # The names and addresses are the machine's: test sessions running at once (two
        # checkouts, say) take turns, or one would tear down the other's hosts.
        self._lock = open(LOCK_FILE, "w")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock.close()
                    raise RuntimeError(f"the test hosts stayed in use by another test "
                                       f"session for {LOCK_WAIT_S:g} s ({LOCK_FILE})")
                time.sleep(0.2)
        try:
            self._network()
            self._keys_and_sshd()
        except BaseException:
            self.close()
            raise

    @property
    def ssh_command(self) -> str:
        return f"ssh -F {os.path.join(self.dir, 'ssh_config')}"

    def veth(self, name: str) -> str:
        """The root-namespace end of ``name``'s link (bring it down to cut the host off)."""
        return f"ddlv{self.names.index(name) + 1}n{self.bridge[5:]}"

    def _remove_network(self) -> None:
        """Delete our links and namespaces (also ones a crashed run left). The links go
        first: a namespace whose sockets outlive its processes (a cut link leaves TCP
        sockets retransmitting) stays alive after ``ip netns del``, and its veth with it."""
        _run("ip", "link", "del", self._mgmt_link, check=False)
        for name in self.names:
            _run("ip", "link", "del", self.veth(name), check=False)
            _run("ip", "netns", "del", name, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def _network(self) -> None:
        self._remove_network()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.addresses[0].rsplit('.', 1)[0]}.254/24", "dev",
             self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for name, address in zip(self.names, self.addresses):
            veth = self.veth(name)
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
                 name)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
        first, mgmt_net = self.names[0], self.management.rsplit(".", 1)[0]
        _run("ip", "link", "add", self._mgmt_link, "type", "veth", "peer", "name", "eth1",
             "netns", first)
        _run("ip", "addr", "add", f"{mgmt_net}.254/24", "dev", self._mgmt_link)
        _run("ip", "link", "set", self._mgmt_link, "up")
        _run("ip", "-n", first, "addr", "add", f"{self.management}/24", "dev", "eth1")
        _run("ip", "-n", first, "link", "set", "eth1", "up")

    def _keys_and_sshd(self) -> None:
        d = self.dir
        for key in ("host_key", "user_key"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(d, key))
        shutil.copy(os.path.join(d, "user_key.pub"), os.path.join(d, "authorized_keys"))
        os.chmod(os.path.join(d, "authorized_keys"), 0o600)
        host_pub = open(os.path.join(d, "host_key.pub")).read().split()[:2]
        with open(os.path.join(d, "known_hosts"), "w") as f:
            for address in self.addresses + [self.management]:
                f.write(f"{address} {' '.join(host_pub)}\n")
        with open(os.path.join(d, "sshd_config"), "w") as f:
            f.write(f"HostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
                    "PidFile none\nLogLevel ERROR\n")
        with open(os.path.join(d, "ssh_config"), "w") as f:
            for name, address in zip(self.names, [self.management] + self.addresses[1:]):
                f.write(f"Host {name}\n  HostName {address}\n")
            f.write(f"Host *\n  User root\n  IdentityFile {d}/user_key\n"
                    f"  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n"
                    f"  GlobalKnownHostsFile /dev/null\n  LogLevel ERROR\n")
        os.makedirs("/run/sshd", exist_ok=True)
        for name, address in zip(self.names, self.addresses):
            # -D: stays in the foreground, so close() can stop exactly this daemon
            listen = ["-o", f"ListenAddress={address}"] + (
                ["-o", f"ListenAddress={self.management}"] if name == self.names[0] else [])
            self._sshd.append(subprocess.Popen(
                ["ip", "netns", "exec", name, SSHD, "-D", "-f", os.path.join(d, "sshd_config")]
                + listen + ["-E", os.path.join(d, f"sshd-{name}.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        for name in self.names:
            while True:
                r = subprocess.run(self.ssh_command.split() + ["-o", "BatchMode=yes", name,
                                                               "true"],
                                   capture_output=True, text=True, timeout=20)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd in {name} did not answer: {r.stderr.strip()}")
                time.sleep(0.1)

    def close(self) -> None:
        for proc in self._sshd:
            proc.terminate()
        for proc in self._sshd:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._sshd = []
        self._remove_network()
        if not self._lock.closed:
            self._lock.close()  # releases the flock
