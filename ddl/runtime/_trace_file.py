"""A Chrome-trace file that is valid JSON after every system call (:class:`TraceFile`).

A process killed at any moment, SIGKILL included, leaves a valid file. Linux applies a
buffered write page by page and checks for a fatal signal before each page, so a write
that spans two pages can be cut between them; one that stays inside one page is all or
nothing. :class:`TraceFile` therefore keeps the closing ``]`` at the end of a
preallocated run of spaces and writes each event (``,\\n{...}``) over spaces, never
across a page boundary; when the spaces run out, or at close (which trims them), it
builds the bigger or trimmed file under a temporary name and renames it into place
(rename is atomic). A failed write (a full disk) puts the spaces back. This holds for
local Linux filesystems (ext4, xfs, tmpfs, overlayfs), not for a machine that loses
power.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import List, Optional

PAGE_BYTES = mmap.PAGESIZE
# Preallocated spaces: a new file has room for this much; a full one grows by half its
# size (at least this much), so copying it costs O(1) per byte overall.
INITIAL_ROOM = 256 * 1024


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a short write, e.g. on a full disk, is
    continued; an error raises ``OSError``)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


def _write_in_page(fd: int, data: bytes, offset: int) -> None:
    """One ``pwrite`` of ``data`` (inside one page, so all or nothing) at ``offset``."""
    n = os.pwrite(fd, data, offset)
    if n != len(data):
        raise OSError(f"short write: {n} of {len(data)} bytes")


def _pad(n: int) -> bytes:
    """``n`` bytes of JSON whitespace: spaces, ending in a newline."""
    return b" " * (n - 1) + b"\n" if n > 0 else b""


def _copy(src: int, dst: int, n: int) -> None:
    """Copy the first ``n`` bytes of file ``src`` to the start of file ``dst``."""
    done = 0
    while done < n:
        try:
            k = os.copy_file_range(src, dst, n - done, done, done)
        except (AttributeError, OSError):  # no copy_file_range here: read and write
            k = os.pwrite(dst, os.pread(src, min(n - done, 1 << 20), done), done)
        if k <= 0:
            raise OSError(f"copying the timeline stopped after {done} of {n} bytes")
        done += k


class TraceFile:
    """A JSON array on disk that is valid after every system call.

    Layout: ``[`` + ``\\n{event}`` + ``,\\n{event}``... + spaces + ``]``, the ``]`` being
    the last byte. :meth:`append` writes events over the spaces, each write inside one
    page (so a SIGKILL cannot cut it); when the spaces run out, :meth:`_rebuild` makes a
    bigger copy under a temporary name and renames it over ``path``. Not thread-safe: the
    caller serializes calls.
    """

    def __init__(self, path: str, first_event: str, room: int = INITIAL_ROOM):
        """Create ``path`` (replacing it; parents are made) holding ``[first_event]``
        followed by ``room`` bytes of spaces. ``first_event`` is one event's JSON text,
        ASCII."""
        self.path = path
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd: Optional[int] = None
        self._end = 0   # where the next ",\n{event}" goes: the end of the events
        self._size = 0  # file size; the "]" is at _size - 1
        self._rebuild(f"[\n{first_event}".encode("ascii"), room)

    def _rebuild(self, head: Optional[bytes], room: int) -> None:
        """Atomically replace the file with: ``head`` (or, if ``None``, the current
        file's events), ``room`` bytes of whitespace and ``]``."""
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if head is None:
                _copy(self._fd, fd, self._end)
                end = self._end
            else:
                _write_all(fd, head, 0)
                end = len(head)
            for at in range(0, room, 1 << 20):
                _write_all(fd, _pad(min(1 << 20, room - at)), end + at)
            _write_all(fd, b"]", end + room)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._end, self._size = fd, end, end + room + 1

    def append(self, events: List[str]) -> None:
        """Add ``events`` (JSON texts of at most
        :data:`~ddl.runtime._trace_events.MAX_EVENT_BYTES`, ASCII) at the end of the
        array: as few writes as possible, none crossing a page boundary (an event that
        would is moved to the next page, leaving spaces). Raises ``OSError`` with the file
        still valid and without the events of the failed write."""
        page, i = PAGE_BYTES, 0
        while i < len(events):
            at, data = self._end, ",\n" + events[i]
            if at // page != (at + len(data) - 1) // page:
                at = (at // page + 1) * page  # start the next page
            limit = (at // page + 1) * page
            i += 1
            while i < len(events) and at + len(data) + len(events[i]) + 2 <= limit:
                data += ",\n" + events[i]
                i += 1
            if at + len(data) > self._size - 1:  # it would reach the "]": more room
                spare = max(INITIAL_ROOM, self._end // 2)
                self._rebuild(None, at + len(data) - self._end + spare)
            raw = data.encode("ascii")
            try:
                _write_in_page(self._fd, raw, at)
            except OSError:
                self._blank(at, len(raw))
                raise
            self._end = at + len(raw)

    def _blank(self, at: int, n: int) -> None:
        """After a failed write of ``n`` bytes at ``at``: spaces there again."""
        try:
            _write_in_page(self._fd, b" " * n, at)
        except OSError:
            pass

    def close(self, trim: bool = True) -> None:
        """Close the file, first replacing it (atomically) by one without the spare
        spaces if ``trim``. Idempotent. Raises ``OSError`` if trimming fails (the file
        is closed, valid, untrimmed)."""
        if self._fd is None:
            return
        try:
            if trim and self._size - self._end > 2:
                self._rebuild(None, 1)
        finally:
            os.close(self._fd)
            self._fd = None

    def abandon(self) -> None:
        """Forget the file without touching it (in a forked child)."""
        self._fd = None
