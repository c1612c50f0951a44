"""One rank of :func:`ddl.run`: ``python -m ddl.launcher._fn_worker IN_FD OUT_FD``.

Reads the pickled ``(fn, args, kwargs)`` from the inherited pipe ``IN_FD`` (never from
argv or the environment), runs ``fn`` between ``ddl.init()`` and ``ddl.shutdown()``, and
writes to ``OUT_FD`` either ``b"R" + pickle(result)`` or ``b"E" + traceback text``.
Exit status 0 on success, 1 if ``fn`` (or unpickling, or pickling the result) failed.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _dumps(obj) -> bytes:
    try:
        import cloudpickle
        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    in_fd, out_fd = int(argv[0]), int(argv[1])
    from ddl.core.pdeathsig import die_with_launcher
    die_with_launcher(int(os.environ.get("DDL_LAUNCHER_PID", "0") or 0))
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
        reply = b"E" + traceback.format_exc().encode("utf-8", errors="replace")
        code = 1
    if initialized and hasattr(ddl, "shutdown"):
        try:
            ddl.shutdown()
        except Exception:
            if code == 0:
                reply = b"E" + traceback.format_exc().encode("utf-8", errors="replace")
                code = 1
    with os.fdopen(out_fd, "wb") as out:
        out.write(reply)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
