"""How DistributedOptimizer puts an allreduced gradient into ``p.grad`` (no world needed)."""

import pytest

torch = pytest.importorskip("torch")


def test_a_gradient_takes_its_result_unless_other_memory_aliases_it():
    from ddl.torch._optimizer import _take_result

    grad, value = torch.zeros(2, 3), torch.arange(6.0).reshape(2, 3)
    _take_result(grad, value)  # owns its memory: takes the result's (no copy)
    assert grad.data_ptr() == value.data_ptr() and torch.equal(grad, value)
    flat = torch.zeros(10)  # a view into a flat buffer of gradients: copied into
    view = flat[2:8].view(2, 3)
    _take_result(view, torch.ones(2, 3))
    assert torch.equal(flat[2:8], torch.ones(6)) and flat[:2].eq(0).all()
    other = torch.zeros(2, 3, dtype=torch.float64)  # another dtype: copied
    _take_result(other, value)
    assert other.dtype == torch.float64 and torch.equal(other, value.double())
