"""Checks of the device data plane for the device worlds of tests/test_contract.py (CuPy
arrays; the stand-in of tests/standin on machines without a GPU). Run in every rank after
the contract, when every group has agreed its device plan."""

from __future__ import annotations

import os

import ddl
from _contract_checks import KINDS


def check_device_plan() -> list:
    """Every group that moved device arrays agreed the plan ``DDL_TEST_DEVICE_EXPECT``
    names (``path:backend[,kind=backend...]``, e.g. ``ipc:cuda_ipc``), the global set's
    among them, and its collectives of every kind and size take that backend (or the one
    named for their kind)."""
    from ddl.dataplane.transports.base import Group
    from ddl.runtime import runtime as _runtime
    from ddl.v1 import coordinator_pb2 as pb
    path, _, backends_text = os.environ["DDL_TEST_DEVICE_EXPECT"].partition(":")
    default, *named = backends_text.split(",")
    want_for = dict(item.split("=") for item in named)
    backends = _runtime.runtime().backends
    plans = dict(backends.plane.device_plans)
    world = tuple(range(ddl.size()))
    me = f"rank {ddl.rank()}"
    out = [f"{me}: the group {ranks} took the device path {p.path} ({p.reason}), want {path}"
           for ranks, p in plans.items() if p.path != path]
    if world not in plans:
        return out + [f"{me}: no device plan for the global set; plans: {sorted(plans)}"]
    group = Group.of(list(world), ddl.rank())
    for kind, op in KINDS.items():
        want = want_for.get(kind, default)
        for size in (4, 1 << 22):
            got = backends.pick(getattr(pb, op), group, size, memory="cuda").name
            if got != want:
                out.append(f"{me}: a device {kind} of {size} bytes runs on {got}, want "
                           f"{want}")
    return out


def check_device_join() -> list:
    """Rank i makes i+1 rounds of device collectives, then joins: joined ranks
    contribute neutral values (on the device they brought to the group), Average counts
    only contributors, allgathers get no rows from them, and join() returns the last rank
    to join; then a device collective of everyone."""
    import cupy
    import numpy as np
    rank, size = ddl.rank(), ddl.size()
    failures = []

    def dev(values, dtype=np.float64):
        with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
            return cupy.asarray(np.asarray(values, dtype))

    for k in range(rank + 1):
        contributors = list(range(k, size))
        total = ddl.allreduce(dev([rank + 1.0]), name=f"djoin/sum/{k}", op=ddl.Sum)
        mean = ddl.allreduce(dev([rank + 1.0]), name=f"djoin/avg/{k}")
        low = ddl.allreduce(dev([rank + 1], np.int32), name=f"djoin/min/{k}", op=ddl.Min)
        rows = ddl.allgather(dev(np.full((1, 2), rank)), name=f"djoin/ag/{k}")
        want = float(sum(r + 1 for r in contributors))
        got = (total.get().tolist(), low.get().tolist(),
               rows.get()[:, 0].astype(int).tolist())
        expect = ([want], [k + 1], contributors)
        average = float(mean.get()[0])   # (prescaled by 1/contributors: within an ulp)
        if (got != expect or abs(average - want / len(contributors)) > 1e-12
                or not isinstance(total, cupy.ndarray)):
            failures.append(f"rank {rank}: device join step {k}: sum, min, rows {got} "
                            f"({type(total).__name__}), mean {average}, want {expect}, "
                            f"{want / len(contributors)}")
    last = ddl.join()
    if last != size - 1:
        failures.append(f"rank {rank}: join() returned {last}, want {size - 1}")
    after = ddl.allreduce(dev(np.ones(2)), name="djoin/after", op=ddl.Sum)
    if after.get().tolist() != [float(size)] * 2:
        failures.append(f"rank {rank}: a device collective after join gave {after}")
    return failures


def check_device_forms() -> list:
    """Device arrays in the forms the contract does not take: asynchronous calls fused in
    one cycle, the same names again (cached: the cycles' own executor and device plan),
    prescale and postscale, Adasum (combined on the host), int64 Average, 0-d and
    non-contiguous inputs. Results are CuPy arrays on the input's device, equal to a
    host reference."""
    import cupy
    import numpy as np
    rank, size = ddl.rank(), ddl.size()
    device = ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()
    failures = []

    def dev(values, dtype=np.float32):
        with cupy.cuda.Device(device):
            return cupy.asarray(np.asarray(values, dtype))

    def expect(what, got, want, tol=0.0):
        if not isinstance(got, cupy.ndarray) or got.device.id != device:
            failures.append(f"rank {rank}: {what}: got {type(got).__name__} on "
                            f"{getattr(got, 'device', None)}, want a CuPy array on "
                            f"cuda:{device}")
            return
        host = got.get()
        if host.shape != np.shape(want) or not np.allclose(host, want, rtol=0, atol=tol):
            failures.append(f"rank {rank}: {what}: got {host.tolist()}, want "
                            f"{np.asarray(want).tolist()}")

    ranks = np.arange(size, dtype=np.float64)
    for again in range(3):   # the 2nd and 3rd rounds are cached
        handles = [ddl.allreduce_async(dev(np.full(n, rank + 1.0)), name=f"dforms/a{n}",
                                       op=ddl.Sum) for n in (1, 7, 1000, 40_003)]
        for n, h in zip((1, 7, 1000, 40_003), handles):
            expect(f"async allreduce [{n}] round {again}", ddl.synchronize(h),
                   np.full(n, (ranks + 1).sum()))
        scaled = ddl.allreduce(dev(np.full(5, rank + 1.0)), name="dforms/scaled",
                               op=ddl.Sum, prescale_factor=2.0, postscale_factor=0.25)
        expect(f"prescale and postscale round {again}", scaled,
               np.full(5, (ranks + 1).sum() * 0.5))
    expect("int64 Average", ddl.allreduce(dev([10 * rank + 1, -7], np.int64),
                                          name="dforms/i64avg"),
           np.array([np.trunc((10 * ranks + 1).sum() / size), -7]))
    expect("0-d", ddl.allreduce(dev(rank + 1.0), name="dforms/0d", op=ddl.Sum),
           np.asarray((ranks + 1).sum()))
    with cupy.cuda.Device(device):
        strided = cupy.arange(20, dtype=cupy.float32)[::2] * (rank + 1)
    expect("non-contiguous", ddl.allreduce(strided, name="dforms/strided", op=ddl.Sum),
           np.arange(20, dtype=np.float32)[::2] * (ranks + 1).sum())
    if size > 1:   # orthogonal inputs: Adasum adds them
        basis = np.zeros(size, np.float32)
        basis[rank] = rank + 1.0
        expect("Adasum", ddl.allreduce(dev(basis), name="dforms/adasum", op=ddl.Adasum),
               ranks + 1, tol=1e-5)
    return failures


def check_device_memory_mismatch() -> list:
    """Rank 0 passes a CuPy array, the others a NumPy one under the same name: every rank
    raises MismatchError naming both kinds of memory and both ranks, and the job goes
    on (a device collective right after it completes)."""
    import cupy
    import numpy as np
    rank = ddl.rank()
    if ddl.size() < 2:
        return []
    with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
        x = cupy.ones(3, cupy.float32) if rank == 0 else np.ones(3, np.float32)
        try:
            ddl.allreduce(x, name="dmismatch/memory")
            return [f"rank {rank}: CuPy on rank 0 and NumPy elsewhere raised nothing"]
        except ddl.MismatchError as exc:
            text = str(exc)
        if "memory mismatch" not in text or "cuda" not in text or "host" not in text:
            return [f"rank {rank}: the memory mismatch says {text!r}"]
        after = ddl.allreduce(cupy.ones(2, cupy.float32), name="dmismatch/after",
                              op=ddl.Sum)
        if after.get().tolist() != [float(ddl.size())] * 2:
            return [f"rank {rank}: after the mismatch, a device allreduce gave {after}"]
    return []


def check_device_process_set_cached() -> list:
    """Device calls on a process set of ranks 0 and 2 (size >= 3), the same names three
    times, so the cycles' executor carries the cached rounds among the set's members."""
    import cupy
    import numpy as np
    if ddl.size() < 3:
        return []
    rank, failures = ddl.rank(), []
    if rank in (0, 2):   # only members add a set
        ps = ddl.add_process_set([0, 2])
        with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
            for again in range(3):
                handles = [ddl.allreduce_async(cupy.full(n, rank + 1.0, cupy.float32),
                                               name=f"dps/{n}", op=ddl.Sum, process_set=ps)
                           for n in (3, 5000)]
                for n, h in zip((3, 5000), handles):
                    got = ddl.synchronize(h)
                    if got.get().tolist() != [4.0] * n:
                        failures.append(f"rank {rank}: process set round {again}: "
                                        f"[{n}] gave {got.get()[:4].tolist()}, want 4.0")
        ddl.remove_process_set(ps)
    ddl.barrier()
    return failures


def check_device_result_release() -> list:
    """Device memory is reused in stream order (CuPy's pool, torch's caching allocator):
    a block freed on a stream goes to the next allocation on that stream at once.

    - An input made on another stream than the call's, dropped right after an
      asynchronous call, and memory taken and written on that stream once the call is
      done on the host, before it is synchronized: the call still reads its input's
      values (it keeps its inputs until its results are released).
    - A result dropped while work queued on the caller's stream still reads it, then a
      collective called from another stream: the result's memory is not reused before
      that work has run, so it reads the first result's values."""
    import time

    import cupy
    import numpy as np
    rank, size = ddl.rank(), ddl.size()
    want = float(sum(r + 1 for r in range(size)))
    failures = []
    with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
        main = cupy.cuda.Stream(non_blocking=True)
        side = cupy.cuda.Stream(non_blocking=True)
        for n in (3, 1000, 40_000):
            with side:
                x = cupy.full(n, rank + 1.0, cupy.float32)
                main.wait_event(side.record())
            with main:
                handle = ddl.allreduce_async(x, name=f"drelease/input/{n}", op=ddl.Sum)
            del x
            deadline = time.monotonic() + 60
            while not ddl.poll(handle) and time.monotonic() < deadline:
                time.sleep(0.001)
            ddl.barrier()   # (a later call: nothing of the first one's is held by chance)
            with side:   # may take the input's memory, were it freed
                junk = cupy.full(n, 99.0, cupy.float32)
                side.synchronize()
            with main:
                got = ddl.synchronize(handle).get()
            del junk
            if not np.all(got == want):
                failures.append(f"rank {rank}: [{n}] an input dropped after an "
                                f"asynchronous call: the call gave {got[:3].tolist()}, "
                                f"want {want}")
        # Sum reads the input in place; Average packs it scaled into a buffer first
        for op, scale, n in ((ddl.Sum, 1.0, 3), (ddl.Sum, 1.0, 1000), (ddl.Sum, 1.0, 40_000),
                             (ddl.Average, 1.0 / size, 1000)):
            with main:
                result = ddl.allreduce(cupy.full(n, rank + 1.0, cupy.float32),
                                       name=f"drelease/first/{op}/{n}", op=op)
                doubled = result * 2   # queued on main: reads the result's memory
            del result
            with side:
                other = ddl.allreduce(cupy.full(n, -1.0, cupy.float32),
                                      name=f"drelease/second/{op}/{n}", op=op)
                second = other.get()
            with main:
                got = doubled.get()
            if not (np.allclose(got, 2 * want * scale, rtol=1e-6, atol=0)
                    and np.allclose(second, -size * scale, rtol=1e-6, atol=0)):
                failures.append(f"rank {rank}: {getattr(op, 'name', op)} [{n}] a result "
                                f"dropped while its stream still read it: that read gave "
                                f"{got[:3].tolist()} "
                                f"(want {2 * want * scale}), the next call "
                                f"{second[:3].tolist()} (want {-size * scale})")
    # the event that a wait for the data plane's stream records (cuda.settle, NCCL's
    # waits), from a thread whose current device is another GPU (as at shutdown): made
    # on the stream's device, as CUDA requires
    from ddl.dataplane.device import cuda as _cuda
    gpus = cupy.cuda.runtime.getDeviceCount()
    device = ddl.local_rank() % gpus
    with cupy.cuda.Device((device + 1) % gpus):
        try:
            _cuda.record_on(_cuda.stream(device)).synchronize()
        except Exception as exc:
            failures.append(f"rank {rank}: waiting for the stream of device {device} from "
                            f"device {(device + 1) % gpus}: {type(exc).__name__}: {exc}")
    return failures


def check_device_fast_lane() -> list:
    """Blocking named device calls on the global set, the same names step after step:
    once cached they take the fast lane (ddl._fast: the collective runs alone, the result
    comes back on the caller's stream), on a stream of the caller's own; the last rank
    meets the others there on the usual (asynchronous) path. Results are CuPy arrays on
    the input's device with the right values."""
    import cupy
    import numpy as np
    from ddl import _fast
    from ddl.runtime import runtime as _runtime
    rank, size = ddl.rank(), ddl.size()
    total = float(sum(r + 1 for r in range(size)))
    failures = []
    lane = _fast.lane(_runtime.runtime())
    before = lane.hits if lane is not None else 0
    with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
        with cupy.cuda.Stream(non_blocking=True):
            for step in range(8):
                x = cupy.full(1000, rank + 1.0 + step, cupy.float32)
                if step == 7 and rank == size - 1:   # the usual path among the lane's
                    total_sum = ddl.synchronize(ddl.allreduce_async(
                        x, name="dlane/sum", op=ddl.Sum))
                else:
                    total_sum = ddl.allreduce(x, name="dlane/sum", op=ddl.Sum)
                got = {
                    "sum": total_sum * 1,   # (read on this stream)
                    "average": ddl.allreduce(x, name="dlane/avg") + 0,
                    "broadcast": ddl.broadcast(x, root_rank=size - 1, name="dlane/bcast"),
                    "allgather": ddl.allgather(x[:4].reshape(1, 4), name="dlane/ag"),
                    "reducescatter": ddl.reducescatter(x[:2 * size].reshape(size, 2),
                                                       name="dlane/rs", op=ddl.Sum),
                }
                # alltoall: rank r sends j + 1 rows of its value to rank j
                splits = [j + 1 for j in range(size)]
                received, got_splits = ddl.alltoall(
                    cupy.full((sum(splits), 2), rank + 1.0 + step, cupy.float32),
                    splits=splits, name="dlane/a2a")
                got["alltoall"] = received
                want_splits = [rank + 1] * size
                if got_splits.tolist() != want_splits:
                    failures.append(f"rank {rank}: fast lane alltoall step {step}: splits "
                                    f"{got_splits.tolist()}, want {want_splits}")
                want = {"sum": np.full(1000, total + size * step),
                        "average": np.full(1000, (total + size * step) / size),
                        "broadcast": np.full(1000, size + step),
                        "allgather": np.repeat(np.arange(1, size + 1) + step, 4).reshape(
                            size, 4),
                        "reducescatter": np.full((1, 2), total + size * step),
                        "alltoall": np.repeat(np.arange(1, size + 1) + step,
                                              2 * (rank + 1)).reshape(-1, 2)}
                for what, value in got.items():
                    if not isinstance(value, cupy.ndarray) or not np.allclose(
                            value.get(), want[what], rtol=1e-6, atol=0):
                        failures.append(f"rank {rank}: fast lane {what} step {step}: got "
                                        f"{type(value).__name__} "
                                        f"{np.asarray(value.get()).ravel()[:3].tolist()}, "
                                        f"want {np.asarray(want[what]).ravel()[:3].tolist()}")
    hits = (lane.hits - before) if lane is not None else 0
    if lane is not None and hits < 36:   # (7 steps of 4 other ops make 28)
        failures.append(f"rank {rank}: the fast lane completed {hits} of 48 blocking device "
                        f"calls")
    return failures
