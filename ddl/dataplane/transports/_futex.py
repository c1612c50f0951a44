"""Cross-process wake-ups on a word of shared memory: Linux futexes through ``ctypes``.

A process that must wait for another to change a 32-bit word of a shared mapping calls
:func:`wait` (``FUTEX_WAIT``): the kernel puts it to sleep only if the word still holds
the value it last saw, atomically with respect to :func:`wake` (``FUTEX_WAKE``). The
non-``PRIVATE`` operations are used on purpose: they key the wait queue by the mapped
file and offset, so they work between processes that map the same segment.

A waker that skips the ``FUTEX_WAKE`` system call when nobody sleeps (the common case
when ranks spin) must order its store of the new value before its load of the
"somebody sleeps" flags; that needs a full memory fence, which Python cannot issue.
:func:`fence` provides one through libatomic's ``atomic_thread_fence(seq_cst)`` (about
0.13 µs through ctypes, against about 1 µs for a ``FUTEX_WAKE`` system call).
:data:`HAVE_FENCE` is false where libatomic is missing; callers must then call
:func:`wake` after every store (correct, only slower). The sleeper's side of that
ordering is the kernel's: ``FUTEX_WAIT`` issues a full barrier before it reads the word.

Only Linux has futexes: :data:`AVAILABLE` says whether this process can use them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

# syscall numbers of futex(2) per machine (asm-generic numbering for the newer ports)
_SYS_FUTEX = {
    "x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
    "ppc64le": 221, "ppc64": 221, "s390x": 238, "loongarch64": 98,
}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
WAKE_ALL = 0x7FFFFFFF
_SEQ_CST = 5  # __ATOMIC_SEQ_CST

# x86 keeps stores in order and loads in order (TSO); elsewhere publishing data before a
# flag also needs a fence on both sides, see ``STRONG_ORDER``.
STRONG_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall(loader):
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = loader(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return fn


def _load_fence():
    for name in ("libatomic.so.1", "libatomic.so"):
        try:
            fn = ctypes.PyDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


# FUTEX_WAIT sleeps, so it lets other threads run (CDLL releases the GIL); the fence and
# FUTEX_WAKE return at once, so they keep the GIL (PyDLL): a release there would let
# another thread take it and keep this one off the CPU for a whole switch interval.
_NR = _SYS_FUTEX.get(platform.machine().lower())
_syscall_wait = _load_syscall(ctypes.CDLL) if _NR else None
_syscall_wake = _load_syscall(ctypes.PyDLL) if _NR else None
_fence = _load_fence()

AVAILABLE = _syscall_wait is not None and _syscall_wake is not None
HAVE_FENCE = _fence is not None


def fence() -> None:
    """A full (sequentially consistent) memory fence; only if :data:`HAVE_FENCE`."""
    _fence(_SEQ_CST)


def wait(addr: int, expected: int, timeout: float) -> int:
    """Sleep while the 32-bit word at ``addr`` equals ``expected``, at most ``timeout`` s.

    Returns 0 when woken, or ``errno.EAGAIN`` (the word had already changed),
    ``errno.ETIMEDOUT`` or ``errno.EINTR``. Spurious returns are possible: the caller
    re-reads the word and decides. Other errors raise ``OSError``.
    """
    timeout = max(timeout, 0.0)
    sec = int(timeout)
    ts = _Timespec(sec, int((timeout - sec) * 1e9))
    rc = _syscall_wait(_NR, addr, _FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.byref(ts), None, 0)
    if rc == 0:
        return 0
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        return err
    raise OSError(err, f"futex wait failed: {os.strerror(err)}")


def wake(addr: int, count: int = WAKE_ALL) -> int:
    """Wake up to ``count`` processes sleeping on the word at ``addr``; returns how many."""
    rc = _syscall_wake(_NR, addr, _FUTEX_WAKE, count, None, None, 0)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake failed: {os.strerror(err)}")
    return rc
