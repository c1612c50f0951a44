"""Barrier on a :class:`~ddl.dataplane.transports.shm.ShmGroup`: one round that carries
nothing but the call's descriptor (the contract every collective of a host group shares:
:mod:`ddl.dataplane.algorithms.shm_collectives`).
"""

from __future__ import annotations

from ddl.dataplane.transports.shm import ShmGroup, descriptor


def barrier(group: ShmGroup, deadline: float) -> None:
    """Return once every rank of the group has called ``barrier``."""
    group.check("barrier")
    if group.size == 1:
        return
    desc = descriptor("barrier", 0)
    try:
        group.begin(deadline, "barrier")
        group.publish(desc)
        group.wait_all(deadline, "barrier", desc)
    except BaseException as exc:
        group.fail(exc)
        raise
