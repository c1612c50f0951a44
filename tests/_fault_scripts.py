"""The worker program of the failure tests (tests/test_failures.py), run by ``ddlrun``::

    ddlrun -np N python -m _fault_scripts OUTDIR SCENARIO '{"rank": 2, "action": ...}'

Every rank writes, atomically (tmp + ``os.replace``), into OUTDIR:

* ``<rank>.pid`` once ``ddl.init()`` returned: ``{"pid", "host", "t"}``;
* ``<rank>.err`` when a ddl call raised: ``{"type", "message", "t", "fields", "call"}``,
  ``t`` being ``time.monotonic()`` (one clock for every process of the host) and
  ``call`` the blocking call that raised (``loop``: its step and when it was made;
  ``{"init": true}``: ``ddl.init()`` itself);
* ``<rank>.ok`` if its scenario finished without an error;
* ``<rank>.acted``: the moment a rank leaves on its own (just before it does).

SIGTERM is ignored (except by a rank whose own action is ``sigterm``) so that ddlrun's
teardown cannot race a rank's report; ddlrun's SIGKILL still ends everything.

Scenarios (the options are a JSON object):

``loop``     allreduce a float32 array of ``nbytes`` (Sum) again and again until an
             error. Rank ``rank`` leaves at step ``at`` with an ``allreduce_async`` of
             the next step in flight, ``delay`` s after submitting it, by ``action``:
             ``exit0`` / ``exit1`` (``sys.exit``), ``abort`` (``os.abort()``),
             ``sigterm`` (SIGTERM to itself), ``raise`` (an uncaught RuntimeError).
             Faults injected through ``DDL_TEST_FAULT`` act on their own. With
             ``"cupy": true`` the array is a CuPy one (the device data plane), on GPU
             ``local_rank % device count``.
``random``   after a warm-up allreduce that opens the data-plane connections, a seeded
             random mix of allreduces (small and large), allgathers and broadcasts,
             until an error (a ``DDL_TEST_FAULT``, armed after the warm-up, ends it).
``stall``    every rank but ``rank`` allreduces ``"never"``; rank ``rank`` sleeps
             ``sleep`` s, then calls allreduce ``"late"`` (which must raise at once).
``order``    rank 0 allreduces ``"A"`` then ``"B"``, every other rank ``"B"`` then
             ``"A"``, all blocking.
``busy``     ``steps`` allreduces checked for exact results; before step 2, rank 1 holds
             the GIL in a C call (libc ``sleep`` through ``ctypes.PyDLL``) for ``gil`` s,
             rank 2 runs ``gc.collect()`` over a heap of ``objects`` lists, rank 3 spins in
             a pure-Python loop for ``spin`` s. Returns what each busy rank measured.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import os
import random
import signal
import socket
import sys
import time

import numpy as np

import ddl
from ddl.core import faults as _faults


def write(outdir: str, name: str, body) -> None:
    path = os.path.join(outdir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


def _leave(outdir: str, rank: int, action: str) -> None:
    write(outdir, f"{rank}.acted", {"t": time.monotonic(), "action": action})
    sys.stdout.flush()
    if action == "exit0":
        sys.exit(0)
    if action == "exit1":
        sys.exit(1)
    if action == "abort":
        os.abort()
    if action == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the signal is delivered at once: never reached
    if action == "raise":
        raise RuntimeError(f"rank {rank} failed on purpose")
    raise SystemExit(f"unknown action {action!r}")


# The blocking call in progress: {"step", "t" (when it was called)}; part of ``.err``.
CALL: dict = {}


def loop(outdir: str, rank: int, opts: dict):
    count = max(1, opts.get("nbytes", 1 << 20) // 4)
    if opts.get("cupy"):
        import cupy
        cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        x = cupy.ones(count, cupy.float32)
    else:
        x = np.ones(count, np.float32)
    acting, at, action = opts.get("rank", -1), opts.get("at", -1), opts.get("action", "")
    for step in itertools.count():
        if rank == acting and step == at and action:
            ddl.allreduce_async(x, name="grad", op=ddl.Sum)
            time.sleep(opts.get("delay", 0.1))
            _leave(outdir, rank, action)
        CALL.update(step=step, t=time.monotonic())
        ddl.allreduce(x, name="grad", op=ddl.Sum)


def random_mix(outdir: str, rank: int, opts: dict):
    # Open every data-plane connection (a ring connects all pairs of up to 3 ranks), then
    # arm the fault: its hits count from here. (A rank lost while the connections are
    # made is a case of its own: test_failures.test_sigkill_while_the_first_connection_is_made.)
    ddl.allreduce(np.ones(1 << 17, np.float32), name="warmup")
    _faults.arm(os.environ.get("DDL_TEST_FAULT"))
    rng = random.Random(opts.get("seed", 0))  # the same sequence on every rank
    for step in itertools.count():
        kind = rng.choice(["small", "large", "large", "allgather", "broadcast"])
        n = rng.randint(1, 4096) if kind == "small" else rng.randint(1 << 16, 1 << 20)
        x = np.full(n, rank + 1, np.float32)
        if kind in ("small", "large"):
            ddl.allreduce(x, name=f"r{step}", op=ddl.Sum)
        elif kind == "allgather":
            ddl.allgather(x, name=f"g{step}")
        else:
            ddl.broadcast(x, root_rank=step % ddl.size(), name=f"b{step}")


def stall(outdir: str, rank: int, opts: dict):
    x = np.ones(4, np.float32)
    if rank == opts["rank"]:
        time.sleep(opts["sleep"])
        t0 = time.monotonic()
        try:
            ddl.allreduce(x, name="late")
        finally:
            write(outdir, f"{rank}.late", {"waited": time.monotonic() - t0})
    t0 = time.monotonic()
    try:
        ddl.allreduce(x, name="never")
    finally:
        write(outdir, f"{rank}.waited", {"waited": time.monotonic() - t0})


def order(outdir: str, rank: int, opts: dict):
    x = np.ones(4, np.float32)
    names = ["A", "B"] if rank == 0 else ["B", "A"]
    return [float(ddl.allreduce(x, name=n, op=ddl.Sum)[0]) for n in names]


def busy(outdir: str, rank: int, opts: dict):
    size, n, took = ddl.size(), 1000, {}
    for step in range(opts.get("steps", 5)):
        if step == 2:
            t0 = time.monotonic()
            if rank == 1:
                ctypes.PyDLL(None).sleep(int(opts["gil"]))
                took["gil_s"] = time.monotonic() - t0
            elif rank == 2:
                heap = [[i] for i in range(opts["objects"])]
                t0 = time.monotonic()
                gc.collect()
                took["gc_s"] = time.monotonic() - t0
                del heap
            elif rank == 3:
                spins = 0
                while time.monotonic() - t0 < opts["spin"]:
                    spins += 1
                took["spin_s"] = time.monotonic() - t0
        x = np.arange(n, dtype=np.float64) * (rank + 1) + step
        got = ddl.allreduce(x, name=f"busy{step}", op=ddl.Sum)
        want = np.arange(n, dtype=np.float64) * (size * (size + 1) // 2) + step * size
        if not np.array_equal(got, want):
            raise SystemExit(f"rank {rank} step {step}: wrong allreduce result {got[:4]}")
    return took


SCENARIOS = {"loop": loop, "random": random_mix, "stall": stall, "order": order,
             "busy": busy}


def _record(outdir: str, rank: int, exc: Exception, call: dict) -> None:
    fields = {k: getattr(exc, k) for k in ("rank", "host", "pid", "name", "op")
              if hasattr(exc, k)}
    write(outdir, f"{rank}.err", {"type": type(exc).__name__, "message": str(exc),
                                  "t": time.monotonic(), "fields": fields, "call": call})


def main() -> None:
    outdir, scenario = sys.argv[1], sys.argv[2]
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    env_rank = int(os.environ["DDL_RANK"])
    if not (env_rank == opts.get("rank") and opts.get("action") == "sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gate = opts.get("init_after")  # a file: init() only once the test created it
    deadline = time.monotonic() + 30
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        ddl.init()
    except ddl.DDLError as exc:
        _record(outdir, env_rank, exc, {"init": True})
        sys.exit(1)
    rank = ddl.rank()
    host = os.environ.get("DDL_HOSTNAME") or socket.gethostname()
    write(outdir, f"{rank}.pid", {"pid": os.getpid(), "host": host, "t": time.monotonic()})
    try:
        result = SCENARIOS[scenario](outdir, rank, opts)
    except ddl.DDLError as exc:
        _record(outdir, rank, exc, CALL)
        sys.exit(1)
    write(outdir, f"{rank}.ok", {"result": result, "t": time.monotonic()})


if __name__ == "__main__":
    main()
