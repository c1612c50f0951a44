"""The file behind a shared-memory group: its name, creation, checks, mapping and removal.

Names are ``ddl-<job>-<32 hex digits>`` in ``/dev/shm``: the job part lets a launcher find
what a crashed job left (:func:`cleanup_job_segments`), the 128 bits come from an HMAC
keyed with the job secret, so nobody without the secret can predict a name. The creator
opens with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 and never reuses a name that
exists; the others accept only a regular file of their own user with mode 0600.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import stat
from typing import Callable, List

from ddl.core.auth import mac
from ddl.core.errors import DDLError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ddl-"


class SharedMemoryError(DDLError):
    """The shared-memory segment could not be created, opened or trusted."""


def _job_tag(job_id: str) -> str:
    if re.fullmatch(r"[0-9A-Za-z]{1,32}", job_id):
        return job_id
    return hashlib.sha256(job_id.encode()).hexdigest()[:16]


def segment_prefix(job_id: str) -> str:
    """The name prefix every segment of ``job_id`` starts with: ``ddl-<job>-``."""
    return f"{NAME_PREFIX}{_job_tag(job_id)}-"


def segment_name(secret: bytes, job_id: str, host_key: str, tag: str = "world") -> str:
    """The file name (in ``/dev/shm``) of a group's segment: prefix + 128 secret bits."""
    digest = mac(bytes(secret), b"ddl-shm-name-v1", job_id.encode(), host_key.encode(),
                 tag.encode())
    return segment_prefix(job_id) + digest[:16].hex()


def cleanup_job_segments(job_id: str, shm_dir: str = SHM_DIR) -> List[str]:
    """Remove every segment of ``job_id`` left in ``shm_dir``; returns the removed names.

    For a launcher, once the job's processes have ended: segments are unlinked as soon as
    every local rank has attached, so only a crash during a rendezvous leaves one. Touches
    only regular files of this user named :func:`segment_prefix` + 32 hex digits.
    """
    prefix = segment_prefix(job_id)
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix) or not re.fullmatch(r"[0-9a-f]{32}", name[len(prefix):]):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
    return sorted(removed)


def create(path: str, nbytes: int, job_id: str) -> int:
    """Create the segment file exclusively, mode 0600, with ``nbytes`` allocated; its fd.

    The pages are allocated now (``posix_fallocate``), so a full ``/dev/shm`` is an error
    here rather than a SIGBUS on first touch.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise SharedMemoryError(
            f"shared-memory segment {path} already exists: a group with the same tag of job "
            f"{job_id} is still open on this host, or a crashed run left it; remove it with "
            f"ddl.dataplane.transports.shm.cleanup_job_segments({job_id!r})") from None
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        st = os.statvfs(os.path.dirname(path))
        raise SharedMemoryError(
            f"no room for a {nbytes}-byte shared-memory segment in {os.path.dirname(path)} "
            f"({st.f_bavail * st.f_frsize} bytes free); give the container more (e.g. "
            f"docker --shm-size) or use a smaller slot_bytes") from exc
    return fd


def open_existing(path: str, nbytes: int, pause: Callable[[], None], expect: str) -> int:
    """Open the segment another process creates; its fd once it has its ``nbytes``.

    Calls ``pause()`` between attempts (it sleeps, and raises at the deadline). ``expect``
    says what this process expects, for the message if the sizes differ.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            pause()
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SharedMemoryError(
                f"refusing shared-memory segment {path}: owner uid {st.st_uid}, mode "
                f"{stat.filemode(st.st_mode)}; expected a regular file of uid {os.geteuid()} "
                f"with mode -rw-------")
        while st.st_size == 0:   # the creator is still allocating it
            pause()
            st = os.fstat(fd)
        if st.st_size != nbytes:
            raise SharedMemoryError(
                f"shared-memory segment {path} has {st.st_size} bytes but {expect} expects "
                f"{nbytes}: the local ranks disagree on the group")
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_segment(fd: int, nbytes: int) -> mmap.mmap:
    """Map the whole segment shared, with its page tables filled in up front."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def unlink_if_same(path: str, fd: int) -> None:
    """Remove ``path`` if it still names the file open as ``fd`` (not a newer segment)."""
    try:
        st, mine = os.stat(path), os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass


def pid_namespace() -> int:
    """This process's pid namespace (inode), 0 if unknown: pids compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (true when in doubt)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True
