"""Bad-input checks that run inside every rank of a 4-rank world."""

import numpy as np

import ddl


def _expect_raise(failures, rank, exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        if missing:
            failures.append(f"rank {rank}: {exc_type.__name__} message {text!r} lacks {missing}")
        return exc
    except Exception as exc:  # the wrong error type is a failure too
        failures.append(f"rank {rank}: expected {exc_type.__name__}, got {exc!r}")
        return exc
    failures.append(f"rank {rank}: expected {exc_type.__name__}, nothing was raised")
    return None


class Elsewhere:
    """An array type of these checks whose adapter (through the public ``ArrayAdapter``
    API) says its bytes live in "cuda" memory while it holds a NumPy array: what the
    leader does with the kinds a rank declares, on a machine without a GPU."""

    def __init__(self, arr):
        self.arr = arr


class ElsewhereAdapter(ddl.ArrayAdapter):
    name = "checks-elsewhere"

    def supports(self, x):
        return isinstance(x, Elsewhere)

    def to_numpy(self, x):
        return x.arr

    def from_numpy(self, arr, like):
        return Elsewhere(arr)

    def memory(self, x):
        return "cuda"


def _check_memory_kinds(f: list, rank: int, size: int) -> None:
    """A device array on one rank and a host array on the others: a mismatch naming both
    kinds and both ranks, also for a name whose host call was cached (and fast-laned)
    before; device arrays on every rank come back as the input's kind."""
    ddl.register_adapter(ElsewhereAdapter())
    on = lambda x: Elsewhere(x) if rank == 1 else x  # noqa: E731
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.allreduce(on(np.zeros(2)), name="x/memory"),
                  "allreduce 'x/memory': memory mismatch: rank 0 sent host, rank 1 sent cuda")
    for _ in range(3):  # cached, then taken by the fast lane
        ddl.allreduce(np.ones(2), name="x/memory-cached", op=ddl.Sum)
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.allreduce(on(np.ones(2)), name="x/memory-cached"),
                  "memory mismatch: rank 0 sent host, rank 1 sent cuda")
    for k in range(2):
        out = ddl.allreduce(Elsewhere(np.ones(2)), name="x/memory-all", op=ddl.Sum)
        if not (isinstance(out, Elsewhere) and np.all(out.arr == size)):
            f.append(f"rank {rank}: device-kind allreduce #{k} gave {out!r}")
    # device-kind arrays with no device data plane (no CuPy here): every member stages
    # them (the group's device plan, agreed once, says so), fused ones too
    outs = ddl.grouped_allreduce([Elsewhere(np.full(3, k, np.float32)) for k in range(3)],
                                 name="x/memory-group", op=ddl.Sum)
    if [o.arr.tolist() for o in outs] != [[k * size] * 3 for k in range(3)]:
        f.append(f"rank {rank}: device-kind grouped allreduce gave {outs!r}")
    rows = ddl.allgather(Elsewhere(np.full((1, 2), rank, np.int32)), name="x/memory-ag")
    if not (isinstance(rows, Elsewhere) and rows.arr[:, 0].tolist() == list(range(size))):
        f.append(f"rank {rank}: device-kind allgather gave {rows!r}")


def check_mismatches() -> list:
    rank, size = ddl.rank(), ddl.size()
    assert size == 4
    f = []
    ok = lambda tag: ddl.allreduce(np.ones(2), name=f"ok/{tag}", op=ddl.Sum)  # noqa: E731

    shape = (18, 17) if rank == 3 else (17, 17)
    exc = _expect_raise(f, rank, ddl.MismatchError,
                        lambda: ddl.allreduce(np.zeros(shape, np.float32), name="grad/fc1"),
                        "allreduce 'grad/fc1': shape mismatch: rank 0 sent float32[17,17], "
                        "rank 3 sent float32[18,17]")
    if exc is not None and isinstance(exc, ddl.MismatchError):
        if (exc.rank_a, exc.rank_b, exc.name) != (0, 3, "grad/fc1"):
            f.append(f"rank {rank}: mismatch fields {exc.rank_a} {exc.rank_b} {exc.name}")
    if not np.all(ok("after-shape") == size):
        f.append(f"rank {rank}: job unusable after a mismatch")

    dtype = np.int32 if rank == 2 else np.float32
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.allreduce(np.zeros(4, dtype), name="x/dtype"),
                  "allreduce 'x/dtype': dtype mismatch: rank 0 sent float32[4], rank 2 sent int32[4]")
    op = ddl.Max if rank == 1 else ddl.Sum
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.allreduce(np.zeros(4), name="x/rop", op=op),
                  "reduce op mismatch", "rank 0 sent Sum", "rank 1 sent Max")
    root = 1 if rank == 3 else 0
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.broadcast(np.zeros(2), root_rank=root, name="x/root"),
                  "broadcast 'x/root': root rank mismatch: rank 0 sent 0, rank 3 sent 1")
    scale = 2.0 if rank == 1 else 1.0
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.allreduce(np.zeros(2), name="x/scale", prescale_factor=scale),
                  "prescale factor mismatch", "rank 1 sent 2")
    call = ((lambda: ddl.broadcast(np.zeros(2), root_rank=0, name="x/op")) if rank == 2 else
            (lambda: ddl.allreduce(np.zeros(2), name="x/op")))
    _expect_raise(f, rank, ddl.MismatchError, call, "'x/op': op mismatch", "rank 0 sent allreduce",
                  "rank 2 sent broadcast")
    tail = (3,) if rank == 1 else (2,)
    _expect_raise(f, rank, ddl.MismatchError,
                  lambda: ddl.allgather(np.zeros((rank + 1,) + tail), name="x/ag"),
                  "allgather 'x/ag': shape mismatch")
    _check_memory_kinds(f, rank, size)
    if not np.all(ok("after-all") == size):
        f.append(f"rank {rank}: job unusable after mismatches")

    # local errors on every rank: each raises its own (tests/_local_error_checks.py has a
    # bad argument on one rank only)
    _expect_raise(f, rank, ddl.InvalidRequestError,
                  lambda: ddl.allreduce(np.array([object()]), name="obj"),
                  f"allreduce 'obj': rank {rank} passed a numpy.ndarray of dtype object")
    _expect_raise(f, rank, ddl.InvalidRequestError,
                  lambda: ddl.allreduce(np.zeros(2, np.complex64), name="c"),
                  f"allreduce 'c': rank {rank} passed a numpy.ndarray of dtype complex64")
    _expect_raise(f, rank, ddl.InvalidRequestError,
                  lambda: ddl.allreduce([1, 2], name="list-of-ints"),
                  f"rank {rank} passed a list of Python numbers ([1, 2])")
    _expect_raise(f, rank, ValueError, lambda: ddl.broadcast(np.zeros(1), root_rank=9, name="r9"),
                  f"broadcast 'r9': rank {rank} passed root_rank=9, but process set 0 has "
                  f"ranks 0..3")
    h = ddl.allreduce_async(np.ones(3), name="dup", op=ddl.Sum)
    _expect_raise(f, rank, ddl.DuplicateNameError,
                  lambda: ddl.allreduce_async(np.ones(3), name="dup"),
                  "'dup'", "already in flight", f"rank {rank}")
    if not np.all(h.wait() == size):
        f.append(f"rank {rank}: first 'dup' call failed")
    # the same name may be reused once the first call finished
    if not np.all(ddl.allreduce(np.ones(3), name="dup", op=ddl.Sum) == size):
        f.append(f"rank {rank}: reusing a finished name failed")
    ddl.barrier()
    return f
