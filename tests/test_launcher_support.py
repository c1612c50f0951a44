"""Helpers shared by the launcher tests (no tests here).

Until ``ddl.server.daemon`` exists, the launcher tests run a stand-in coordinator through
``DDL_TEST_COORDINATOR_CMD`` (honoured by ``ddl.launcher._job``). The stand-in takes the
daemon's arguments, listens on the unix socket, and exits 0 on SIGTERM; with
``DDL_TEST_STANDIN_EXIT`` = ``"<seconds>:<code>"`` it exits with ``code`` after
``seconds`` instead, and with ``DDL_TEST_STANDIN_NO_SOCKET=1`` it never creates the socket.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

STAND_IN = textwrap.dedent(r'''
    import os, signal, socket, sys, time
    args = sys.argv[1:]
    addr = args[args.index("--address") + 1]
    assert addr.startswith("unix:"), addr
    assert os.environ.get("DDL_JOB_SECRET") and os.environ.get("DDL_JOB_ID")
    path = addr[len("unix:"):]
    def bye(*_):
        try:
            os.unlink(path)
        except OSError:
            pass
        os._exit(0)
    signal.signal(signal.SIGTERM, bye)
    if os.environ.get("DDL_TEST_STANDIN_NO_SOCKET") != "1":
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen(64)
    print("stand-in coordinator for", args[args.index("--size") + 1], "ranks",
          file=sys.stderr, flush=True)
    plan = os.environ.get("DDL_TEST_STANDIN_EXIT")
    if plan:
        seconds, code = plan.split(":")
        time.sleep(float(seconds))
        os._exit(int(code))
    while True:
        time.sleep(60)
''')


def have_daemon() -> bool:
    """Whether the real coordinator exists (``DDL_TEST_FORCE_STAND_IN=1``: pretend not)."""
    if os.environ.get("DDL_TEST_FORCE_STAND_IN") == "1":
        return False
    try:
        return importlib.util.find_spec("ddl.server.daemon") is not None
    except ModuleNotFoundError:
        return False


def stand_in_cmd(tmp_path) -> str:
    path = tmp_path / "stand_in_coordinator.py"
    path.write_text(STAND_IN)
    return f"{sys.executable} {path}"


def job_env(tmp_path, *, force_stand_in: bool = False, **extra) -> dict:
    """Environment for a launcher run: a unique marker, and the stand-in if needed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env["DDL_TEST_MARKER"] = uuid.uuid4().hex
    if force_stand_in or not have_daemon():
        env["DDL_TEST_COORDINATOR_CMD"] = stand_in_cmd(tmp_path)
    env.update(extra)
    return env


def script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def ddlrun(args, env, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddl.launcher.cli", *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                          text=True)


def marked_pids(marker: str) -> list:
    """Pids of live (non-zombie) processes whose environment holds DDL_TEST_MARKER=marker."""
    needle = f"DDL_TEST_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry))
    return found


def assert_no_survivors(marker: str, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = marked_pids(marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job survived: {left}"


def wait_for_files(paths, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.02)
