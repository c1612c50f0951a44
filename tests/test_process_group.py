"""ddl.core.process_group.signal_group: one signal reaches a child and what it started."""

import os
import signal
import subprocess
import time

from ddl.core.process_group import signal_group


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
