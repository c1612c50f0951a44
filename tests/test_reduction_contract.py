"""The reduction contract (README "Reductions", ``ddl.ReduceOp``) at every dtype's edges,
on every path: shared memory, the response cache (inline and as collectives, fused or
not), reducescatter, hierarchical on two simulated nodes, flat TCP (a process set across
the nodes here, ``DDL_TRANSPORT=tcp`` in test_cache.py). Ranks run with
``PYTHONWARNINGS=error::RuntimeWarning``: a NumPy overflow warning fails the call."""

from __future__ import annotations

import numpy as np
import pytest

import ddl
import _reduction_checks

STRICT = {"PYTHONWARNINGS": "error::RuntimeWarning"}


def _failures(results):
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:60])


@pytest.mark.timeout(300)
def test_edges_over_shared_memory_and_the_cache():
    def run():
        return (_reduction_checks.check_edges()
                + _reduction_checks.check_scaled_and_joined())
    _failures(ddl.run(run, np=3, env=STRICT))


@pytest.mark.timeout(300)
def test_edges_hierarchical_and_tcp_on_two_nodes():
    """Global set: hierarchical (shared memory within a node, TCP across), cached calls
    agreed over TCP; the set {0, 2} (one rank per node): flat TCP."""
    def run():
        from ddl import _runtime
        from ddl.transports.base import Group
        hierarchy = _runtime.runtime().local_groups.hierarchy
        out = [] if hierarchy(Group.of(range(4), ddl.rank())) is not None else [
            f"rank {ddl.rank()}: the global set does not run hierarchically"]
        out += _reduction_checks.check_edges()
        if ddl.rank() in (0, 2):  # only members add a set
            ps = ddl.add_process_set([0, 2])
            out += _reduction_checks.check_edges(ps, tag="ps/")
        ddl.barrier()
        return out
    _failures(ddl.run(run, np=4, env=dict(STRICT, DDL_TEST_LOCAL_NODES="2,2",
                                          DDL_HIERARCHICAL_ALLREDUCE="on")))
