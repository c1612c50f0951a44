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
