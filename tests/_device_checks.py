"""Checks of the device data plane for the device worlds of tests/test_contract.py (CuPy
arrays; the stand-in of tests/standin on machines without a GPU). Run in every rank after
the contract, when every group has agreed its device plan."""

from __future__ import annotations

import os

import ddl
from _contract_checks import KINDS


def check_device_plan() -> list:
    """Every group that moved device arrays agreed the plan ``DDL_TEST_DEVICE_EXPECT``
    names (``path:backend``, e.g. ``ipc:cuda_ipc``), the global set's among them, and its
    collectives of every kind and size take that backend."""
    from ddl.dataplane.transports.base import Group
    from ddl.runtime import runtime as _runtime
    from ddl.v1 import coordinator_pb2 as pb
    path, backend = os.environ["DDL_TEST_DEVICE_EXPECT"].split(":")
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
        for size in (4, 1 << 22):
            got = backends.pick(getattr(pb, op), group, size, memory="cuda").name
            if got != backend:
                out.append(f"{me}: a device {kind} of {size} bytes runs on {got}, want "
                           f"{backend}")
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
