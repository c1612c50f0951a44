"""One rank's bad argument fails the collective on every member at once, naming that rank
and the reason, and the job goes on (issue 15); bad input that only the calling rank can
see is refused there with a message naming the value."""

import pytest

import ddl
import _local_error_checks


@pytest.mark.timeout(240)
def test_a_bad_argument_on_one_rank_fails_every_member_at_once():
    # every wait is bounded (add_process_set has no timeout= of its own)
    results = ddl.run(_local_error_checks.check_one_rank_bad_argument, np=3,
                      env={"DDL_COLLECTIVE_TIMEOUT_SECONDS": "20"})
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_input_gaps_of_the_public_functions_in_a_one_rank_job():
    failures = ddl.run(_local_error_checks.check_single_rank_inputs, np=1)[0]
    assert not failures, "\n".join(failures)
