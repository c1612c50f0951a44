"""One rank's bad argument fails every member at once: checks that run inside every rank
of a 3-rank world (tests/test_local_errors.py).

Each case is a collective (sync or async form, global or sub process set) that every
member calls under one name, one rank with a bad argument, the others with good ones.
Every member must raise the same InvalidRequestError, whose text names the bad rank and
the reason, well within ``GUARD_S`` (the timeout every call waits with, so that a
regression fails in seconds instead of waiting for the job's 900 s timeout); then every
member makes the call again, correctly, under the same name, and it must succeed.
"""

import time

import numpy as np

import ddl

GUARD_S = 8.0  # every wait in here; a hang fails the case after this long
DTYPES = ("uint8, int8, uint16, int16, int32, int64, float16, bfloat16, float32, float64, "
          "bool")
ARRAY = ("an array (a NumPy array, or a framework tensor once its ddl client, e.g. "
         "ddl.torch, is imported) or a list, tuple or dict of arrays")
OPS = "ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product"


def _sync(fn, *args, **kwargs):
    return lambda name: fn(*args, name=name, timeout=GUARD_S, **kwargs)


def _async(fn, *args, **kwargs):
    return lambda name: fn(*args, name=name, **kwargs).wait(GUARD_S)


def _cases(size, ps):
    """``(label, op, members, bad rank, bad call, good call, reason, failing leaf, check)``
    with calls taking the name; ``check(result)`` says whether a good result is right."""
    ones, n = np.ones(4, np.float32), size
    is_sum = lambda k: lambda out: np.allclose(out, k)  # noqa: E731
    everyone = tuple(range(size))
    sub = tuple(ps.ranks)
    cases = [
        ("allreduce dtype", "allreduce", everyone, 1,
         _sync(ddl.allreduce, np.zeros(4, np.complex64), op=ddl.Sum),
         _sync(ddl.allreduce, ones, op=ddl.Sum),
         f"passed a numpy.ndarray of dtype complex64, which ddl does not support; "
         f"supported dtypes: {DTYPES}", "", is_sum(n)),
        ("allreduce None", "allreduce", everyone, 0,
         _sync(ddl.allreduce, None), _sync(ddl.allreduce, ones),
         f"passed None; allreduce takes {ARRAY}", "", is_sum(1)),
        ("allreduce list of numbers", "allreduce", everyone, 2,
         _sync(ddl.allreduce, [1.0, 2.0]), _sync(ddl.allreduce, np.array([1.0, 2.0])),
         "passed a list of Python numbers ([1.0, 2.0]); ddl reads a list as a group of "
         "arrays: pass np.asarray([1.0, 2.0]) to send it as one array", "",
         lambda out: np.allclose(out, [1.0, 2.0])),
        ("allreduce op", "allreduce", everyone, 1,
         _sync(ddl.allreduce, ones, op="sum"), _sync(ddl.allreduce, ones, op=ddl.Sum),
         f"passed op='sum'; op must be one of {OPS}", "", is_sum(n)),
        ("allreduce prescale nan", "allreduce", everyone, 2,
         _sync(ddl.allreduce, ones, prescale_factor=float("nan")),
         _sync(ddl.allreduce, ones, prescale_factor=2.0),
         "passed prescale_factor=nan; it must be finite", "", is_sum(2)),
        ("allreduce postscale str", "allreduce", everyone, 0,
         _sync(ddl.allreduce, ones, postscale_factor="2"),
         _sync(ddl.allreduce, ones, postscale_factor=2),
         "passed postscale_factor='2' (str); it must be a real number", "", is_sum(2)),
        ("allreduce timeout", "allreduce", everyone, 1,
         lambda name: ddl.allreduce(ones, name=name, timeout=-1.0),
         _sync(ddl.allreduce, ones),
         "passed timeout=-1.0; it must be >= 0 seconds (or None)", "", is_sum(1)),
        ("allreduce_async dtype", "allreduce", everyone, 2,
         _async(ddl.allreduce_async, np.array(["a", "b"]), op=ddl.Sum),
         _async(ddl.allreduce_async, ones, op=ddl.Sum),
         f"passed a numpy.ndarray of dtype <U1, which ddl does not support; supported "
         f"dtypes: {DTYPES}", "", is_sum(n)),
        ("allreduce bool Sum (leader's check)", "allreduce", everyone, 1,
         _sync(ddl.allreduce, np.ones(4, bool), op=ddl.Sum),
         _sync(ddl.allreduce, np.ones(4, bool), op=ddl.Max),
         "sent reduce op Sum with dtype bool; only Min (logical and) and Max (logical or) "
         "are defined on bool", "", lambda out: out.dtype == bool and out.all()),
        ("grouped_allreduce one leaf", "allreduce", everyone, 0,
         _sync(ddl.grouped_allreduce, [ones, np.zeros(2, np.complex128)], op=ddl.Sum),
         _sync(ddl.grouped_allreduce, [ones, np.ones(2)], op=ddl.Sum),
         f"passed a numpy.ndarray of dtype complex128, which ddl does not support; "
         f"supported dtypes: {DTYPES} (at '{{name}}/1' in this call)", "/0",
         lambda out: np.allclose(out[0], n) and np.allclose(out[1], n)),
        ("grouped_allreduce_async not a list", "allreduce", everyone, 2,
         _async(ddl.grouped_allreduce_async, ones, op=ddl.Sum),
         _async(ddl.grouped_allreduce_async, [ones], op=ddl.Sum),
         "passed a numpy.ndarray to grouped_allreduce, which takes a list or tuple of "
         "arrays (for one array, use allreduce)", "/0", lambda out: np.allclose(out[0], n)),
        ("allgather object dtype", "allgather", everyone, 1,
         _sync(ddl.allgather, np.array([object()])), _sync(ddl.allgather, ones),
         f"passed a numpy.ndarray of dtype object, which ddl does not support; supported "
         f"dtypes: {DTYPES}", "", lambda out: out.shape == (4 * n,)),
        ("allgather_async python int", "allgather", everyone, 0,
         _async(ddl.allgather_async, 3), _async(ddl.allgather_async, np.array([3])),
         f"passed a Python int (3); allgather takes {ARRAY}: pass np.asarray(3)", "",
         lambda out: list(out) == [3] * n),
        ("broadcast root out of range", "broadcast", everyone, 1,
         _sync(ddl.broadcast, ones, root_rank=7), _sync(ddl.broadcast, ones, root_rank=0),
         f"passed root_rank=7, but process set 0 has ranks 0..{n - 1}", "", is_sum(1)),
        ("broadcast_async root str", "broadcast", everyone, 2,
         _async(ddl.broadcast_async, ones, root_rank="0"),
         _async(ddl.broadcast_async, ones, root_rank=0),
         "passed root_rank='0' (str); it must be an int", "", is_sum(1)),
        ("alltoall splits floats", "alltoall", everyone, 0,
         _sync(ddl.alltoall, np.ones(3), splits=[1.5, 1.5, 0]),
         _sync(ddl.alltoall, np.ones(3), splits=[1, 1, 1]),
         "passed splits=[1.5, 1.5, 0]; splits must be 3 ints, the rows sent to each member",
         "", lambda out: list(out[1]) == [1] * n),
        ("alltoall splits sum", "alltoall", everyone, 1,
         _sync(ddl.alltoall, np.ones(3), splits=[1, 1, 2]),
         _sync(ddl.alltoall, np.ones(3), splits=[1, 1, 1]),
         "passed splits [1, 1, 2] (sum 4) for an array of shape [3]; splits must sum to "
         "dim 0", "", lambda out: list(out[1]) == [1] * n),
        ("alltoall_async pytree", "alltoall", everyone, 2,
         _async(ddl.alltoall_async, [np.ones(3)]), _async(ddl.alltoall_async, np.ones(3)),
         "passed a list; alltoall takes one array, not a pytree", "",
         lambda out: list(out[1]) == [1] * n),
        ("reducescatter op", "reducescatter", everyone, 1,
         _sync(ddl.reducescatter, np.ones(3), op=42),
         _sync(ddl.reducescatter, np.ones(3), op=ddl.Sum),
         f"passed op=42; op must be one of {OPS}", "", is_sum(n)),
        ("reducescatter_async pytree", "reducescatter", everyone, 0,
         _async(ddl.reducescatter_async, {"a": np.ones(3)}),
         _async(ddl.reducescatter_async, np.ones(3), op=ddl.Sum),
         "passed a dict; reducescatter takes one array, not a pytree", "", is_sum(n)),
        ("barrier timeout nan", "barrier", everyone, 2,
         lambda name: ddl.barrier(timeout=float("nan")),
         lambda name: ddl.barrier(timeout=GUARD_S),
         "passed timeout=nan; it must be finite", "", lambda out: out is None),
        ("process set allreduce dtype", "allreduce", sub, sub[-1],
         _sync(ddl.allreduce, np.zeros(4, np.complex64), process_set=ps),
         _sync(ddl.allreduce, ones, op=ddl.Sum, process_set=ps),
         f"passed a numpy.ndarray of dtype complex64, which ddl does not support; "
         f"supported dtypes: {DTYPES}", "", is_sum(len(sub))),
        ("process set broadcast root outside", "broadcast", sub, sub[0],
         _async(ddl.broadcast_async, ones, root_rank=n - 1, process_set=ps),
         _async(ddl.broadcast_async, ones, root_rank=sub[0], process_set=ps),
         f"passed root_rank={n - 1}, but process set {ps.process_set_id} has ranks "
         f"{list(sub)}", "", is_sum(1)),
    ]
    return cases


def _run_case(f, rank, label, name, call, expected, members):
    """Run ``call(name)``; it must raise InvalidRequestError with ``expected`` in time."""
    t0 = time.monotonic()
    try:
        call(name)
    except ddl.InvalidRequestError as exc:
        took = time.monotonic() - t0
        if str(exc) != expected:
            f.append(f"rank {rank}: {label}: got {str(exc)!r}, expected {expected!r}")
        if took > GUARD_S / 2:
            f.append(f"rank {rank}: {label}: the error took {took:.1f} s")
        return
    except Exception as exc:  # e.g. DDLTimeoutError: it hung
        f.append(f"rank {rank}: {label}: expected InvalidRequestError {expected!r}, got "
                 f"{exc!r} after {time.monotonic() - t0:.1f} s")
        return
    f.append(f"rank {rank}: {label}: nothing was raised")


def check_one_rank_bad_argument() -> list:
    """Every case in turn, then the same names again with good calls (see module doc)."""
    rank, size = ddl.rank(), ddl.size()
    f = []
    ps = ddl.add_process_set([0, 1]) if rank in (0, 1) else ddl.ProcessSet([0, 1])
    # names cached on every rank before one rank's call with them goes bad
    warm = np.ones(4, np.float32)
    for _ in range(3):
        ddl.allreduce(warm, name="case/cached-allreduce", op=ddl.Sum, timeout=GUARD_S)
        ddl.broadcast(warm, root_rank=0, name="case/cached-broadcast", timeout=GUARD_S)
    cases = _cases(size, ps)
    cases += [
        ("cached allreduce, bad dtype", "allreduce", tuple(range(size)), 2,
         _sync(ddl.allreduce, np.zeros(4, np.complex64), op=ddl.Sum),
         _sync(ddl.allreduce, warm, op=ddl.Sum),
         f"passed a numpy.ndarray of dtype complex64, which ddl does not support; "
         f"supported dtypes: {DTYPES}", "", lambda out: np.allclose(out, size)),
        ("cached broadcast, bad root", "broadcast", tuple(range(size)), 1,
         _sync(ddl.broadcast, warm, root_rank=size),
         _sync(ddl.broadcast, warm, root_rank=0),
         f"passed root_rank={size}, but process set 0 has ranks 0..{size - 1}", "",
         lambda out: np.allclose(out, 1)),
    ]
    for i, (label, op, members, bad, bad_call, good_call, reason, leaf, check) in \
            enumerate(cases):
        if rank not in members:
            continue
        if label.startswith("cached"):
            name = f"case/{label.split()[0]}-{op}"
        elif op == "barrier":
            name = None
        else:
            name = f"case/{i}"
        shown = name if name is not None else "barrier.noname.0"
        expected = f"{op} '{shown}{leaf}': rank {bad} {reason.replace('{name}', shown)}"
        _run_case(f, rank, label, name, bad_call if rank == bad else good_call, expected,
                  members)
        try:  # the job goes on, and the name can be used again
            out = good_call(name)
            if not check(out):
                f.append(f"rank {rank}: {label}: the good call after the error gave {out!r}")
        except Exception as exc:
            f.append(f"rank {rank}: {label}: the good call after the error raised {exc!r}")
    ddl.barrier(timeout=GUARD_S)
    return f
