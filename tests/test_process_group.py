"""ddl.core.process_group: one signal reaches a child and what it started; stop_group
escalates from SIGTERM to SIGKILL."""

import os
import signal
import subprocess
import time

from ddl.core.process_group import signal_group, stop_group


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_signal_group_reaches_grandchildren_and_tolerates_a_gone_group():
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        assert _alive(grandchild)
        signal_group(proc, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), f"grandchild {grandchild} survived its group's kill"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    signal_group(proc, signal.SIGTERM)  # the group is gone: no error


def test_stop_group_terms_then_kills_what_ignores_sigterm():
    # one child exits on SIGTERM; one traps it and must be killed after the grace time
    polite = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True)
    try:
        assert stubborn.stdout.readline() == "ready\n"
        stop_group(polite, grace_s=5.0)
        assert polite.returncode == -signal.SIGTERM
        stop_group(stubborn, grace_s=0.5)
        assert stubborn.returncode == -signal.SIGKILL
    finally:
        for proc in (polite, stubborn):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stubborn.stdout.close()
