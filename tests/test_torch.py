"""ddl.torch in a real 2-rank job: collectives on tensors, autograd, state broadcast,
SyncBatchNorm, DistributedOptimizer (misuse, numerical contract) and join."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("torch") is None:  # (not imported here: the ranks do)
    pytest.skip("ddl.torch needs torch (pip install torch)", allow_module_level=True)

import ddl  # noqa: E402


def _all_checks():
    import ddl.torch  # noqa: F401  (registers the tensor adapter in this rank)
    import _torch_checks as c
    return (c.check_collectives() + c.check_autograd() + c.check_state_broadcast()
            + c.check_sync_batch_norm() + c.check_optimizer_misuse()
            + c.check_optimizer_features()
            + c.check_numerical_contract() + c.check_join_uneven())


@pytest.mark.timeout(240)
def test_torch_in_a_2_rank_world():
    # a call nobody answers becomes a StallError naming it well before the test timeout
    results = ddl.run(_all_checks, np=2, env={"DDL_STALL_CHECK_TIME_SECONDS": "15",
                                              "DDL_STALL_SHUTDOWN_TIME_SECONDS": "60"})
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
