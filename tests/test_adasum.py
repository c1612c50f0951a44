"""ddl.core.adasum on its own (no world): the tree formula, its properties, per-segment
combining and the neutral zero. Multi-rank checks are tests/_checks.py::check_adasum."""

import numpy as np
import pytest

from ddl.core import adasum

from _checks import reference_adasum


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_tree_matches_the_formula_for_any_member_count(n):
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(9) for _ in range(n)]
    np.testing.assert_allclose(adasum.tree(xs), reference_adasum(xs), rtol=1e-13, atol=1e-13)


def test_three_members_carry_the_odd_one_up():
    rng = np.random.default_rng(3)
    x0, x1, x2 = (rng.standard_normal(4) for _ in range(3))
    np.testing.assert_allclose(adasum.tree([x0, x1, x2]),
                               adasum.pair(adasum.pair(x0, x1), x2), rtol=0, atol=0)


def test_properties_identical_orthogonal_and_zero():
    a = np.array([1.0, -2.0, 3.0])
    assert np.array_equal(adasum.tree([a, a, a, a]), a)
    eye = np.eye(3)
    assert np.array_equal(adasum.tree(list(eye)), np.ones(3))
    zero = np.zeros(3)
    assert np.array_equal(adasum.pair(a, zero), a) and np.array_equal(adasum.pair(zero, a), a)
    assert np.array_equal(adasum.pair(zero, zero), zero)


def test_segments_combine_on_their_own_into_the_wire_dtype():
    same = np.array([1.0, 2.0], np.float32)
    parts = [np.concatenate([same, np.eye(2, dtype=np.float32)[k]]) for k in range(2)]
    out = np.empty(4, np.float32)
    adasum.combine_into(parts, [2, 2], out)
    assert out.tolist() == [1.0, 2.0, 1.0, 1.0]  # identical segment; orthogonal segment
    whole = np.empty(4, np.float32)
    adasum.combine_into(parts, [4], whole)
    assert whole.tolist() != out.tolist()  # one dot product over both gives neither
    f16 = [p.astype(np.float16) for p in parts]
    adasum.combine_into(f16, [2, 0, 2], f16[0])  # in place, an empty segment
    assert f16[0].dtype == np.float16 and f16[0].tolist() == [1.0, 2.0, 1.0, 1.0]
