"""A world of one rank: every collective, dtype and shape, against NumPy.

Worlds of 2, 3 and 4 ranks run the same checks (``_checks``) in test_contract.py, over
TCP, shared memory and hierarchically.
"""

import pytest

import ddl
import _checks


def _run_checks(n, *checks):
    results = ddl.run(_all_checks, args=(checks,), np=n)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
    return results


def _all_checks(names):
    out = []
    for name in names:
        out.extend(getattr(_checks, name)())
    return out


@pytest.mark.timeout(240)
def test_collectives_against_numpy_in_a_world_of_one():
    _run_checks(1, "check_collectives", "check_join")
