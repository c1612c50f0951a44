"""Randomized collectives on real worlds, checked exactly against NumPy.

1,000 collectives by default, split over one world of each size 1-5. Each is drawn from
a logged seed: world size, collective (allreduce with every reduce op and sometimes
pre/postscale factors, grouped_allreduce, allgather with uneven first dimensions,
broadcast from a random root, alltoall with random splits, reducescatter), dtype, size
(0, 1, world +- 1, odd counts around the 64 KiB small-message and 1 MiB chunk edges, up to
4 Mi elements), process set (worlds of 3+), sync or ``_async`` waited out of order.
Pass figure: zero wrong results. See ``_random_checks`` for the plan and the references.

Environment:

* ``DDL_TEST_SEED=<int>`` replays a seed; without it a fresh seed is drawn. The seed is
  printed and is part of every failure line, together with the world size and case index.
* ``DDL_TEST_RANDOM_COUNT=<int>`` sets the number of collectives (default 1000); the
  long run is ``DDL_TEST_RANDOM_COUNT=10000``.

Replay a failure with ``DDL_TEST_SEED=<seed> python -m pytest
tests/test_random_collectives.py -k "world<N>"``; a case's parameters do not depend on the
count, so a count that reaches the failing case is enough.
"""

from __future__ import annotations

import os
import secrets

import pytest

import ddl
import _random_checks

WORLDS = [1, 2, 3, 4, 5]


def _env_int(name: str, default: int) -> int:
    """A non-negative integer from the environment, or ``default`` when unset."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    value = int(text)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {text!r}")
    return value


SEED = _env_int("DDL_TEST_SEED", secrets.randbelow(2 ** 32))
COUNT = _env_int("DDL_TEST_RANDOM_COUNT", 1000)
# Generous: the default count takes well under a minute in all; a hang must still end.
TIMEOUT_S = 120 + COUNT // 10


def cases_in_world(world: int) -> int:
    """This world's share of COUNT: an even split, the remainder to the smaller worlds."""
    base, extra = divmod(COUNT, len(WORLDS))
    return base + (1 if WORLDS.index(world) < extra else 0)


def _summary(world: int, failures) -> str:
    head = (f"{len(failures)} wrong results or errors in world {world}; replay with "
            f"DDL_TEST_SEED={SEED} DDL_TEST_RANDOM_COUNT={COUNT}")
    return "\n".join([head] + list(failures[:40]))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("world", WORLDS, ids=[f"world{n}" for n in WORLDS])
def test_random_collectives_against_numpy(world, record_property):
    print(f"DDL_TEST_SEED={SEED} DDL_TEST_RANDOM_COUNT={COUNT} world={world}")
    record_property("ddl_test_seed", SEED)
    count = cases_in_world(world)
    results = ddl.run(_random_checks.run_cases, args=(SEED, world, count), np=world,
                      env={"DDL_COLLECTIVE_TIMEOUT_SECONDS": "60"})
    failures = [f for per_rank in results for f in per_rank["failures"]]
    assert not failures, _summary(world, failures)

    # every rank ran exactly the cases it is a member of
    cases = _random_checks.plan(SEED, world, count)
    for rank, per_rank in enumerate(results):
        want = sum(rank in case.members for case in cases)
        assert per_rank["done"] == want, (f"seed={SEED} world={world} rank={rank}: "
                                          f"completed {per_rank['done']} of {want} cases")
