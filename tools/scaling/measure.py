"""The benchmark runs the fit uses: ``ddl-bench --op allreduce --csv`` on

* ``shm_np2``: 2 ranks on this host (shared memory and the response cache's cycles);
* ``tcp_np2``: 2 ranks on this host over loopback TCP (``DDL_TRANSPORT=tcp``);
* ``link_np2``: 2 test hosts (network namespaces with their own sshd, tests/_netns.py),
  one rank each, each host's sending side shaped to ``LINK_RATE`` with a token bucket
  (``tc qdisc ... tbf``; needs root, iproute2, openssh-server).

Each writes docs/scaling/data/<name>.csv; :mod:`.report` fits α and β from them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(ROOT, "docs", "scaling", "data")
SIZES = "4,64,1K,16K,64K,256K,1M,4M,16M,64M"
LINK_SIZES = "4,64,1K,16K,64K,256K,1M,4M,16M"
LINK_RATE = "1gbit"  # tc's spelling; LINK_BYTES_PER_S below must match
LINK_BYTES_PER_S = 1e9 / 8


def _bench(args, sizes: str, out: str, env: dict) -> None:
    cmd = [sys.executable, "-m", "ddl.launcher.cli", *args, sys.executable, "-m", "ddl.bench",
           "--op", "allreduce", "--sizes", sizes, "--csv", "--output", out]
    subprocess.run(cmd, env=env, check=True, timeout=900, stdin=subprocess.DEVNULL)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env.update(extra)
    return env


def run(which=("shm_np2", "tcp_np2", "link_np2")) -> None:
    os.makedirs(DATA, exist_ok=True)
    if "shm_np2" in which:
        _bench(["-np", "2"], SIZES, os.path.join(DATA, "shm_np2.csv"), _env())
    if "tcp_np2" in which:
        _bench(["-np", "2"], SIZES, os.path.join(DATA, "tcp_np2.csv"),
               _env(DDL_TRANSPORT="tcp"))
    if "link_np2" in which:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import _netns
        why = _netns.unavailable()
        if why:
            raise SystemExit(f"no test hosts: {why}")
        with tempfile.TemporaryDirectory() as d:
            hosts = _netns.TestHosts(2, d, net=79)
            try:
                for name in hosts.names:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev",
                                    "eth0", "root", "tbf", "rate", LINK_RATE, "burst", "128kb",
                                    "latency", "100ms"], check=True)
                _bench(["-np", "2", "-H", ",".join(f"{n}:1" for n in hosts.names)],
                       LINK_SIZES, os.path.join(DATA, "link_np2.csv"),
                       _env(DDL_SSH_COMMAND=hosts.ssh_command))
            finally:
                hosts.close()
