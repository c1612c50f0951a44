"""Where an input's bytes live, as each adapter reports it for ``Request.memory`` (no world
needed; the leader's check of the kinds across ranks runs in test_contract.py's
hierarchical world, ``_error_checks._check_memory_kinds``)."""

import subprocess
import sys

import numpy as np
import pytest

from ddl import _adapters, _args


def test_numpy_is_host_memory_and_cupy_is_looked_for_only_among_imported_modules():
    adapter, array, wire, memory, problem = _args.host_array(np.ones(3, np.float32))
    assert (adapter.name, memory, problem) == ("numpy", "", "") and wire
    # CuPy's adapter is built in but never imports CuPy: without it, nothing is CuPy's
    code = ("import sys, numpy as np, ddl\n"
            "from ddl import _adapters\n"
            "assert not _adapters.CupyAdapter().supports(np.ones(1))\n"
            "assert 'cupy' not in sys.modules, 'importing ddl imported cupy'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert [a.name for a in _adapters._ADAPTERS][-2:] == ["numpy", "cupy"]


def test_torch_tensors_report_their_device_type():
    torch = pytest.importorskip("torch")
    import ddl.torch  # noqa: F401  (registers the adapter)

    cpu = torch.ones(2)
    adapter, _, _, memory, problem = _args.host_array(cpu)
    assert (adapter.name, memory, problem) == ("torch", "", "")
    # a device that is no CPU is reported by its type (meta tensors exist everywhere)
    assert adapter.memory(torch.empty(2, device="meta")) == "meta"


def test_device_arrays_are_said_once_to_be_staged_through_host_memory(caplog):
    import ddl
    from _error_checks import Elsewhere, ElsewhereAdapter  # an array type in "cuda" memory

    ddl.register_adapter(ElsewhereAdapter())
    _adapters._STAGED.discard("cuda")
    with caplog.at_level("WARNING", logger="ddl"):
        for _ in range(3):
            assert _args.host_array(Elsewhere(np.ones(2)))[3] == "cuda"
        _args.host_array(np.ones(2))
    staged = [r.getMessage() for r in caplog.records if "staged" in r.getMessage()]
    assert staged == ["ddl: cuda arrays are staged through host memory (one copy from the "
                      "device and one back per call): the device data plane needs CuPy and "
                      "a GPU (pip install 'ddl-train[cuda]' for CUDA 12, 'ddl-train[cuda13]' "
                      "for CUDA 13; docs/gpu.md)"], staged
