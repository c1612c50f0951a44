"""Real multi-process worlds: every collective, dtype and shape, against NumPy.

One world per size (1-4); each checks hundreds of collectives, so the suite starts few
processes.
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
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_against_numpy(n):
    checks = ["check_collectives", "check_join"] + (["check_process_sets"] if n >= 3 else [])
    _run_checks(n, *checks)
