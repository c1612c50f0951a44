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
        ("grouped_reducescatter not a list", "reducescatter", everyone, 1,
         _sync(ddl.grouped_reducescatter, np.ones((n, 2)), op=ddl.Sum),
         _sync(ddl.grouped_reducescatter, [np.ones((n, 2))], op=ddl.Sum),
         "passed a numpy.ndarray to grouped_reducescatter, which takes a list or tuple of "
         "arrays (for one array, use reducescatter)", "/0",
         lambda out: out[0].shape == (1, 2) and np.allclose(out[0], n)),
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
        ("process set never registered", "allreduce", sub, sub[-1],
         _sync(ddl.allreduce, ones, op=ddl.Sum, process_set=ddl.ProcessSet(list(sub))),
         _sync(ddl.allreduce, ones, op=ddl.Sum, process_set=ps),
         f"passed a process set that was never registered, ProcessSet(process_set_id=None, "
         f"ranks={list(sub)}, mpi_comm=None); pass the ProcessSet that ddl.add_process_set({list(sub)}) returned "
         f"(process set {ps.process_set_id})", "", is_sum(len(sub))),
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
        shown = name if name is not None else "barrier"
        expected = f"{op} '{shown}{leaf}': rank {bad} {reason.replace('{name}', shown)}"
        _run_case(f, rank, label, name, bad_call if rank == bad else good_call, expected,
                  members)
        try:  # the job goes on, and the name can be used again
            out = good_call(name)
            if not check(out):
                f.append(f"rank {rank}: {label}: the good call after the error gave {out!r}")
        except Exception as exc:
            f.append(f"rank {rank}: {label}: the good call after the error raised {exc!r}")
    _bad_add_process_set(f, rank)
    # a bad join fails on its rank alone (the others wait for every rank's join anyway)
    if rank == 1:
        _expect(f, "rank 1: join timeout nan", ddl.InvalidRequestError,
                "join 'join': rank 1 passed timeout=nan; it must be finite",
                lambda: ddl.join(timeout=float("nan")))
    t0 = time.monotonic()
    try:
        last = ddl.join(timeout=GUARD_S)
        if last not in range(size):
            f.append(f"rank {rank}: join returned {last!r}")
    except Exception as exc:
        f.append(f"rank {rank}: join after rank 1's bad join raised {exc!r} after "
                 f"{time.monotonic() - t0:.1f} s")
    ddl.barrier(timeout=GUARD_S)
    return f


def _bad_add_process_set(f, rank: int) -> None:
    """Rank 1 passes add_process_set ranks it cannot even name a set by: rank 0, which
    waits for it in add_process_set([0, 1]) (before or after the bad call), fails at once
    naming rank 1; then both add the set."""
    bad = "add_process_set: rank 1 passed invalid ranks [0.5, 1]: process set ranks " \
          "must be ints, but [0.5, 1] has 0.5 (float)"
    for when in ("waiting", "later"):
        label = f"add_process_set, rank 0 {when}"
        if rank == 1 and when == "waiting":
            time.sleep(0.3)  # rank 0's call is at the leader first
        if rank == 1:
            _expect(f, f"rank 1: {label}", TypeError,
                    "process set ranks must be ints, but [0.5, 1] has 0.5 (float)",
                    lambda: ddl.add_process_set([0.5, 1]))
        if when == "later":
            ddl.barrier(timeout=GUARD_S)
        if rank == 0:
            t0 = time.monotonic()
            _expect(f, f"rank 0: {label}", ddl.InvalidRequestError, bad,
                    lambda: ddl.add_process_set([0, 1]))
            if time.monotonic() - t0 > GUARD_S / 2:
                f.append(f"rank 0: {label}: raised after {time.monotonic() - t0:.1f} s")
        ddl.barrier(timeout=GUARD_S)
        if rank in (0, 1):
            try:
                again = ddl.add_process_set([0, 1])
                out = ddl.allreduce(np.ones(2), op=ddl.Sum, name=f"after-bad-add-{when}",
                                    process_set=again, timeout=GUARD_S)
                if not np.allclose(out, 2):
                    f.append(f"rank {rank}: {label}: the set's allreduce gave {out!r}")
            except Exception as exc:
                f.append(f"rank {rank}: {label}: adding the set again raised {exc!r}")
        ddl.barrier(timeout=GUARD_S)


def _expect(f, label, exc_type, message, fn):
    """``fn()`` must raise exactly ``exc_type`` (or a subclass) with ``message``."""
    try:
        fn()
    except exc_type as exc:
        if str(exc) != message:
            f.append(f"{label}: got {str(exc)!r}, expected {message!r}")
        return
    except Exception as exc:
        f.append(f"{label}: expected {exc_type.__name__} {message!r}, got {exc!r}")
        return
    f.append(f"{label}: nothing was raised")


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling here")


def check_single_rank_inputs() -> list:
    """Input gaps of the public functions, in a job of one rank (see test_local_errors)."""
    assert ddl.size() == 1
    f = []
    one = np.ones(2)
    ps = "process set ranks must be ints, but "
    cases = [
        # process sets: never a silent int()
        ("add_process_set float", TypeError, f"{ps}[0.5, 1] has 0.5 (float)",
         lambda: ddl.add_process_set([0.5, 1])),
        ("add_process_set bool", TypeError, f"{ps}[True] has True (bool)",
         lambda: ddl.add_process_set([True])),
        ("add_process_set numpy float", TypeError,
         f"{ps}[np.float64(0.0)] has np.float64(0.0) (float64)",
         lambda: ddl.add_process_set([np.float64(0)])),
        ("add_process_set duplicates", ValueError,
         "process set ranks must be distinct, but [0, 0] repeats [0]",
         lambda: ddl.add_process_set([0, 0])),
        ("add_process_set negative", ValueError,
         "process set ranks must be >= 0, but [-1, 0] has [-1]",
         lambda: ddl.add_process_set([-1, 0])),
        ("add_process_set out of range", ValueError,
         "add_process_set: ranks [5] are outside [0, 1)", lambda: ddl.add_process_set([0, 5])),
        ("add_process_set empty", ValueError, "a process set needs at least one rank",
         lambda: ddl.add_process_set([])),
        ("add_process_set int", TypeError,
         "a process set takes a list of ranks (ints), not int 3", lambda: ddl.add_process_set(3)),
        ("add_process_set str", TypeError,
         "a process set takes a list of ranks (ints), not str '0'",
         lambda: ddl.add_process_set("0")),
        ("remove_process_set list", TypeError,
         "remove_process_set takes a ddl.ProcessSet, not list [0]",
         lambda: ddl.remove_process_set([0])),
        ("collective with a list as process set", TypeError,
         "process_set must be a ddl.ProcessSet, not list",
         lambda: ddl.allreduce(one, name="ps", process_set=[0])),
        # names
        ("lone surrogate", ValueError,
         "name 'a\\udc80' is not valid Unicode: surrogates not allowed at index 1 "
         "('\\udc80'); names travel as UTF-8", lambda: ddl.allreduce(one, name="a\udc80")),
        ("empty name", ValueError, "name must be a non-empty string, not ''",
         lambda: ddl.broadcast(one, 0, name="")),
        ("bytes name", TypeError, "name must be a str, not bytes (b'x')",
         lambda: ddl.allgather(one, name=b"x")),
        ("long name", ValueError,
         f"name {'x' * 79!r}... is 5000 bytes long in UTF-8; names may have at most 4096"
         .replace("'...", "..."), lambda: ddl.allreduce(one, name="x" * 5000)),
        ("object name", ValueError, "name must be a non-empty string, not ''",
         lambda: ddl.broadcast_object(1, name="")),
        ("allgather_object name", TypeError, "name must be a str, not int (3)",
         lambda: ddl.allgather_object(1, name=3)),
        # arrays
        ("allreduce None", ddl.InvalidRequestError,
         f"allreduce 'n': rank 0 passed None; allreduce takes {ARRAY}",
         lambda: ddl.allreduce(None, name="n")),
        ("allreduce list of floats", ddl.InvalidRequestError,
         "allreduce 'l': rank 0 passed a list of Python numbers ([1.0, 2.0]); ddl reads a "
         "list as a group of arrays: pass np.asarray([1.0, 2.0]) to send it as one array",
         lambda: ddl.allreduce([1.0, 2.0], name="l")),
        ("allreduce list with a number", ddl.InvalidRequestError,
         "allreduce 'm/0': rank 0 passed a list holding a Python float (1.0) at '1', where "
         "an array is needed; pass np.asarray(...) instead (at 'm/1' in this call)",
         lambda: ddl.allreduce([one, 1.0], name="m")),
        ("allreduce str", ddl.InvalidRequestError,
         f"allreduce 's': rank 0 passed a builtins.str ('abc'); ddl collectives take {ARRAY}",
         lambda: ddl.allreduce("abc", name="s")),
        # scale factors, ops and timeouts
        ("prescale inf", ddl.InvalidRequestError,
         "allreduce 'p': rank 0 passed prescale_factor=inf; it must be finite",
         lambda: ddl.allreduce(one, name="p", prescale_factor=float("inf"))),
        ("postscale bool", ddl.InvalidRequestError,
         "reducescatter 'q': rank 0 passed postscale_factor=True (bool); it must be a real "
         "number", lambda: ddl.reducescatter(one, name="q", postscale_factor=True)),
        ("op bool", ddl.InvalidRequestError,
         f"allreduce 'o': rank 0 passed op=True; op must be one of {OPS}",
         lambda: ddl.allreduce(one, name="o", op=True)),
        ("collective timeout nan", ddl.InvalidRequestError,
         "allgather 't': rank 0 passed timeout=nan; it must be finite",
         lambda: ddl.allgather(one, name="t", timeout=float("nan"))),
        ("join timeout str", ddl.InvalidRequestError,
         "join 'join': rank 0 passed timeout='1' (str); it must be a real number",
         lambda: ddl.join(timeout="1")),
        ("handle wait nan", ValueError,
         "timeout must be None or a finite number of seconds >= 0, not nan",
         lambda: ddl.allreduce_async(one, name="w").wait(float("nan"))),
        ("synchronize negative", ValueError,
         "timeout must be None or a finite number of seconds >= 0, not -1",
         lambda: ddl.synchronize(ddl.allreduce_async(one, name="w2"), timeout=-1)),
        # objects
        ("broadcast_object unpicklable", ddl.InvalidRequestError,
         "broadcast 'bo/size': rank 0 passed an object that cannot be pickled "
         "(_Unpicklable): TypeError: no pickling here",
         lambda: ddl.broadcast_object(_Unpicklable(), name="bo")),
        ("allgather_object unpicklable", ddl.InvalidRequestError,
         "allgather 'allgather_object/sizes': rank 0 passed an object that cannot be "
         "pickled (_Unpicklable): TypeError: no pickling here",
         lambda: ddl.allgather_object(_Unpicklable())),
        ("broadcast_object root", ddl.InvalidRequestError,
         "broadcast 'broadcast_object/size': rank 0 passed root_rank=2, but process set 0 "
         "has ranks [0]", lambda: ddl.broadcast_object(1, root_rank=2)),
    ]
    for label, exc_type, message, fn in cases:
        _expect(f, label, exc_type, message, fn)
    # every name refused above is free, the job goes on
    for name in ("n", "l", "m", "s", "p", "o", "t", "w", "w2"):
        if not np.allclose(ddl.allreduce(one, name=name, timeout=GUARD_S), 1):
            f.append(f"name {name!r} unusable after its error")
    if ddl.broadcast_object({"a": 1}, name="bo") != {"a": 1}:
        f.append("broadcast_object unusable after its error")
    if ddl.allgather_object(2) != [2]:
        f.append("allgather_object unusable after its error")
    if ddl.add_process_set([np.int64(0)]).process_set_id != 0:
        f.append("add_process_set([np.int64(0)]) is not the global set")
    return f
