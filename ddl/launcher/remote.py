"""The remote end of one ssh connection: ``python -m ddl.launcher.remote``.

ddlrun starts each process on another host (a coordinator or a worker) as this agent.
The agent reads one JSON line from standard input::

    {"argv": [...], "env": {...}, "cwd": "...", "interfaces": [...], "host": "h2",
     "verbose": false}

(the job secret is in ``env``, so it never appears on a command line), picks this host's
address, replaces ``{bind}`` in ``argv`` and ``env`` values by it (and ``{launcher}`` in
``env`` values by the address ddlrun's ssh connection came from), and runs ``argv`` in
``cwd`` with this host's environment plus ``env``. Its output goes back through ssh.

Address: the first of ``interfaces`` (``--network-interface``) that has an IPv4
address here, else the address the launcher's ssh connection reached
(``SSH_CONNECTION``), else the one this host routes from towards the launcher.

Lifetime: the agent exits with the child's status (a signal ``s`` gives ``128 + s``).
When its standard input closes (the launcher exited, or ssh's connection dropped) or it
receives SIGTERM, SIGHUP or SIGINT, it sends SIGTERM to the child's process group and
SIGKILL after 3 s. The child also dies with the agent (parent-death signal). With
``"heartbeat_timeout": T`` in the spec (the elastic launcher's workers), the launcher
writes a byte to standard input every second, and T seconds without one count as
standard input closed: a launcher whose host or link went away (a cut link closes
nothing here until TCP gives up, minutes later) leaves nothing running on this host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from ddl.core.pdeathsig import preexec_die_with_parent
from ddl.core.process_group import signal_group, stop_group

KILL_AFTER_S = 3.0
PLACEHOLDER = "{bind}"
LAUNCHER = "{launcher}"  # ddlrun's address as this host reaches it (elastic jobs)


def choose_address(interfaces: List[str], environ: Dict[str, str]) -> tuple:
    """(address, why) for this host; see the module doc."""
    from ddl.launcher._ssh import interface_address, route_source
    for name in interfaces:
        try:
            return interface_address(name), f"interface {name}"
        except ValueError:
            continue
    if interfaces:
        raise SystemExit(f"ddl-remote: none of the interfaces {', '.join(interfaces)} has "
                         f"an IPv4 address on this host")
    parts = environ.get("SSH_CONNECTION", "").split()
    if len(parts) == 4:
        return parts[2], "the address ddlrun's ssh connection reached"
    if len(parts) >= 1 and parts[0]:
        return route_source(parts[0]), "the route towards ddlrun's host"
    return "127.0.0.1", "no ssh connection: loopback"


def main() -> int:
    line = sys.stdin.buffer.readline()
    try:
        spec = json.loads(line)
        argv: List[str] = list(spec["argv"])
        extra: Dict[str, str] = {str(k): str(v) for k, v in spec.get("env", {}).items()}
    except (ValueError, KeyError, TypeError) as exc:
        print(f"ddl-remote: bad launch spec on standard input: {exc}", file=sys.stderr)
        return 2
    if spec.get("address"):  # ddlrun probed which address every other host reaches
        address, why = spec["address"], "every other host reached it in ddlrun's probe"
    else:
        address, why = choose_address(list(spec.get("interfaces", [])), dict(os.environ))
    if spec.get("verbose"):
        print(f"ddl-remote: host {spec.get('host', '?')} uses {address} ({why})",
              file=sys.stderr, flush=True)
    argv = [a.replace(PLACEHOLDER, address) for a in argv]
    env = dict(os.environ)
    launcher = (os.environ.get("SSH_CONNECTION", "").split() or ["127.0.0.1"])[0]
    env.update({k: v.replace(PLACEHOLDER, address).replace(LAUNCHER, launcher)
                for k, v in extra.items()})
    env["DDL_LAUNCHER_PID"] = str(os.getpid())  # ddl's own programs die with the agent
    cwd = spec.get("cwd") or None
    if cwd and not os.path.isdir(cwd):
        print(f"ddl-remote: the working directory {cwd} does not exist on host "
              f"{spec.get('host', '?')}", file=sys.stderr)
        return 127
    report_dir = ""
    if "report_rank" in spec:  # the rank's failure report goes back on stderr
        import tempfile
        report_dir = tempfile.mkdtemp(prefix="ddl-report-")
        env["DDL_REPORT_DIR"] = report_dir
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                preexec_fn=preexec_die_with_parent(os.getpid()))
    except OSError as exc:
        print(f"ddl-remote: cannot start {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    stopping = threading.Event()

    def stop(reason: Optional[str] = None) -> None:
        if stopping.is_set():
            return
        stopping.set()
        threading.Thread(target=stop_group, args=(proc, KILL_AFTER_S), daemon=True).start()

    signalled: list = []

    def on_signal(signum: int, _frame: object) -> None:
        """stop() for a signal, taking no lock (the interrupted main thread may hold it):
        SIGTERM to the group now, SIGKILL from a timer signal KILL_AFTER_S later."""
        if signalled:
            return
        signalled.append(signum)
        signal_group(proc, signal.SIGTERM)
        signal.signal(signal.SIGALRM, lambda _s, _f: signal_group(proc, signal.SIGKILL))
        signal.setitimer(signal.ITIMER_REAL, KILL_AFTER_S)

    heard = [time.monotonic()]

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):  # unbuffered: nothing holds a lock at exit
                heard[0] = time.monotonic()
        except OSError:
            pass
        stop("standard input closed")

    def watch_heartbeat(timeout: float) -> None:
        while not stopping.wait(0.25):
            if time.monotonic() - heard[0] > timeout:
                print(f"ddl-remote: no heartbeat from ddlrun for {timeout:g} s on host "
                      f"{spec.get('host', '?')} (its host or the link to it is gone); "
                      f"stopping {argv[0]}", file=sys.stderr, flush=True)
                stop("no heartbeat")
                return

    threading.Thread(target=watch_stdin, daemon=True).start()
    if spec.get("heartbeat_timeout"):
        threading.Thread(target=watch_heartbeat, args=(float(spec["heartbeat_timeout"]),),
                         daemon=True).start()
    relayed = threading.Event()

    def relay_report() -> None:
        """Send the rank's failure report as soon as it exists (before its exit)."""
        from ddl.core import report as _report
        rank = int(spec["report_rank"])
        while not relayed.is_set():
            line = _report.relay_line(report_dir, rank)
            if line is not None:
                relayed.set()
                sys.stderr.flush()
                os.write(2, line)
                return
            if proc.poll() is not None:
                return
            relayed.wait(0.05)

    reporter = None
    if report_dir:
        reporter = threading.Thread(target=relay_report, daemon=True)
        reporter.start()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, on_signal)
    code = proc.wait()
    signal_group(proc, signal.SIGKILL)  # what the child left in its group
    if reporter is not None:
        reporter.join(1.0)
        if not relayed.is_set():
            relayed.set()
            from ddl.core import report as _report
            line = _report.relay_line(report_dir, int(spec["report_rank"]))
            if line is not None:
                sys.stderr.flush()
                os.write(2, line)
        import shutil
        shutil.rmtree(report_dir, ignore_errors=True)
    return 128 - code if code < 0 else code


def probe() -> int:
    """``python -m ddl.launcher.remote probe``: see :mod:`ddl.launcher._probe`."""
    from ddl.launcher._probe import serve
    parts = os.environ.get("SSH_CONNECTION", "").split()
    serve(sys.stdin.buffer, sys.stdout.buffer, [parts[2]] if len(parts) == 4 else [])
    return 0


if __name__ == "__main__":
    status = probe() if sys.argv[1:] == ["probe"] else main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the stdin watcher is still blocked in read()
