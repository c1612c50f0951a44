"""ddl.tensorflow and ddl.keras in one real 2-rank world (TensorFlow imports slowly, so
one world checks everything)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("tensorflow") is None:  # (not imported here: the ranks do)
    pytest.skip("ddl.tensorflow needs TensorFlow (pip install 'ddl[tensorflow]')",
                allow_module_level=True)

import ddl  # noqa: E402


def _all_checks():
    import _tf_checks as c
    return (c.check_collectives_in_three_modes() + c.check_gradients()
            + c.check_tape_contract() + c.check_keras_fit() + c.check_v1_monitored_session()
            + c.check_sparse_gradients() + c.check_tape_options())


@pytest.mark.timeout(300)
def test_tensorflow_and_keras_in_a_2_rank_world():
    results = ddl.run(_all_checks, np=2, env={"TF_CPP_MIN_LOG_LEVEL": "3",
                                              "DDL_STALL_CHECK_TIME_SECONDS": "15",
                                              "DDL_STALL_SHUTDOWN_TIME_SECONDS": "60"})
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
