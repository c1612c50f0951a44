"""One rank of :func:`ddl.run`: ``python -m ddl.launcher._fn_worker IN_FD OUT_FD``.

Reads the pickled ``(fn, args, kwargs)`` from the inherited pipe ``IN_FD`` (never from
argv or the environment), runs ``fn`` between ``ddl.init()`` and ``ddl.shutdown()``, and
writes to ``OUT_FD`` either ``b"R" + pickle(result)`` or ``b"E" + traceback text``.
Exit status 0 on success, 1 if ``fn`` (or unpickling, or pickling the result) failed.

``python -m ddl.launcher._fn_worker --serve IN_FD OUT_FD`` is a rank that stays up
between calls (:class:`ddl.launcher.engine_ranks.RankServer`, a Ray actor's): it joins
its job (``ddl.init()``) and answers ``b"O"`` (or ``b"E"`` and ends), then runs each
call read from ``IN_FD`` in turn, each answered as above (``b"Q"`` instead of ``b"R"``
when the call shut ddl down: the last answer), with modules, objects and the job itself
kept from one call to the next. Both ways the pipes carry frames (an 8-byte
length, then the bytes). It ends, leaving its job, when ``IN_FD`` closes, after a call
that raised (so that its peers fail at once rather than wait for it in a collective it
will not join) or after a call that shut ddl down.
"""

from __future__ import annotations

import os
import pickle
import select
import sys
import time
import traceback
from typing import Optional

_LENGTH = 8  # bytes of a frame's length, big-endian


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _dumps(obj) -> bytes:
    try:
        import cloudpickle
        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj)


def write_frame(fd: int, data: bytes) -> None:
    """Write one frame (its length, then ``data``) to the pipe ``fd``."""
    view = memoryview(len(data).to_bytes(_LENGTH, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int, deadline: Optional[float] = None) -> Optional[bytes]:
    """The next frame from the pipe ``fd``; None at its end (the writer is gone).
    TimeoutError past ``deadline`` (``time.monotonic()``; None: no deadline)."""
    head = _read_exact(fd, _LENGTH, deadline)
    if head is None:
        return None
    return _read_exact(fd, int.from_bytes(head, "big"), deadline)


def _read_exact(fd: int, count: int, deadline: Optional[float]) -> Optional[bytes]:
    out = bytearray()
    while len(out) < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no frame on fd {fd} before the deadline")
        chunk = os.read(fd, min(count - len(out), 1 << 20))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _failure() -> bytes:
    return b"E" + traceback.format_exc().encode("utf-8", errors="replace")


def serve(in_fd: int, out_fd: int) -> int:
    """The ``--serve`` mode (see the module doc); its exit status."""
    import ddl
    try:
        ddl.init()
    except BaseException:  # noqa: B902 - the traceback goes back to the caller
        _reply(out_fd, _failure())
        return 1
    _reply(out_fd, b"O")
    code = 0
    while code == 0 and ddl.is_initialized():
        call = read_frame(in_fd)
        if call is None:
            break  # the owner closed the pipe: the job ends
        try:
            fn, args, kwargs = pickle.loads(call)
            result = _dumps(fn(*args, **kwargs))
            # "Q": the last answer (the call shut ddl down), so the owner waits for the end
            reply = (b"R" if ddl.is_initialized() else b"Q") + result
        except BaseException:  # noqa: B902 - the traceback goes back to the caller
            reply, code = _failure(), 1
        _reply(out_fd, reply)
    if ddl.is_initialized():
        try:
            ddl.shutdown()
        except Exception:  # noqa: BLE001 - the job's end: nobody waits for an answer
            code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _reply(fd: int, data: bytes) -> None:
    try:
        write_frame(fd, data)
    except BrokenPipeError:
        pass  # the owner is gone (and this process dies with it)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from ddl.core.pdeathsig import die_with_launcher
    die_with_launcher(int(os.environ.get("DDL_LAUNCHER_PID", "0") or 0))
    if argv[0] == "--serve":
        return serve(int(argv[1]), int(argv[2]))
    in_fd, out_fd = int(argv[0]), int(argv[1])
    import ddl
    initialized = False
    try:
        fn, args, kwargs = pickle.loads(_read_all(in_fd))
        if hasattr(ddl, "init"):
            ddl.init()
            initialized = True
        reply = b"R" + _dumps(fn(*args, **kwargs))
        code = 0
    except BaseException:  # noqa: B902 - the traceback goes back to the caller
        reply, code = _failure(), 1
    if initialized and hasattr(ddl, "shutdown"):
        try:
            ddl.shutdown()
        except Exception:
            if code == 0:
                reply, code = _failure(), 1
    with os.fdopen(out_fd, "wb") as out:
        out.write(reply)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
