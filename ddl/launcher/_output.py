"""Forward a child's output line by line with a ``[rank]<stream>:`` prefix.

One reader thread per pipe. Lines are decoded with ``errors="replace"``, a partial last
line is flushed at EOF, and each line is written whole under a per-destination lock so
lines of different ranks never interleave; :func:`write_line` writes the launcher's own
lines under the same lock, so they never land inside a rank's line. Optionally the raw
bytes are also written to a file (``--output-filename``). With ``timestamps`` each
forwarded line starts with the local time it arrived (``--prefix-output-with-timestamp``,
as horovodrun's).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, IO, Dict, List, Optional

_LOCKS: Dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock_for(dest: IO[str]) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(dest), threading.Lock())


def write_line(dest: IO[str], text: str) -> None:
    """Write ``text`` and a newline to ``dest`` as one piece, between forwarded lines."""
    with _lock_for(dest):
        try:
            dest.write(text + "\n")
            dest.flush()
        except (OSError, ValueError):
            pass  # our own stream closed: a log line is not worth failing the job over


class Forwarder:
    """Reader threads that copy pipes to text destinations with a prefix."""

    def __init__(self, timestamps: bool = False) -> None:
        self._threads: List[threading.Thread] = []
        self._timestamps = timestamps

    def add(self, pipe: IO[bytes], prefix: str, dest: Optional[IO[str]],
            raw_file: Optional[IO[bytes]] = None,
            mute: Optional[threading.Event] = None,
            intercept: Optional[Callable[[bytes], bool]] = None) -> threading.Thread:
        """Start copying ``pipe`` until EOF (``dest=None``, or ``mute`` set: drain only);
        ``raw_file`` is closed at EOF. ``intercept(line)`` returning True consumes a line
        (a message for the launcher, not output). Returns the copying thread."""
        t = threading.Thread(target=self._copy,
                             args=(pipe, prefix, dest, raw_file, mute, intercept,
                                   self._timestamps),
                             name=f"ddlrun-output {prefix}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    @staticmethod
    def _copy(pipe: IO[bytes], prefix: str, dest: Optional[IO[str]],
              raw_file: Optional[IO[bytes]], mute: Optional[threading.Event],
              intercept: Optional[Callable[[bytes], bool]] = None,
              timestamps: bool = False) -> None:
        lock = _lock_for(dest)
        try:
            for line in iter(pipe.readline, b""):
                if intercept is not None and intercept(line):
                    continue
                if raw_file is not None:
                    raw_file.write(line)
                    raw_file.flush()
                if dest is None or (mute is not None and mute.is_set()):
                    continue
                text = line.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"
                stamp = time.strftime("%a %b %d %H:%M:%S %Y") if timestamps else ""
                with lock:
                    try:
                        dest.write(stamp + prefix + text)
                        dest.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout closed: keep draining so the child never blocks
        finally:
            pipe.close()
            if raw_file is not None:
                raw_file.close()

    def join(self, timeout: float) -> bool:
        """Wait until every pipe hit EOF, at most ``timeout`` seconds; True if all did.

        A grandchild that inherited a pipe can hold it open; then we stop waiting.
        """
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
