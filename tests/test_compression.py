"""The one Compression implementation (ddl._compression), with NumPy's cast; the clients'
namespaces built from it (torch and TensorFlow when installed)."""

import numpy as np
import pytest

from ddl._client_api import BFLOAT16, compressions

Compression = compressions(lambda a, dtype: a.astype(dtype),
                           lambda a: np.issubdtype(a.dtype, np.floating),
                           fp16=np.dtype(np.float16), bf16=BFLOAT16)


def test_none_passes_through():
    a = np.arange(5, dtype=np.float32)
    wire, ctx = Compression.none.compress(a)
    assert wire is a and Compression.none.decompress(wire, ctx) is a


@pytest.mark.parametrize("name,wire_dtype", [("fp16", np.float16), ("bf16", BFLOAT16)])
def test_cast_floats_and_back(name, wire_dtype):
    comp = getattr(Compression, name)
    a = np.array([1.5, -2.25, 3.0], dtype=np.float64)
    wire, ctx = comp.compress(a)
    assert wire.dtype == wire_dtype and ctx == np.float64
    back = comp.decompress(wire, ctx)
    assert back.dtype == np.float64 and np.array_equal(back, a)


@pytest.mark.parametrize("dtype", [np.int32, np.float16])
def test_integers_and_wire_dtype_travel_as_they_are(dtype):
    a = np.arange(4, dtype=dtype)
    wire, ctx = Compression.fp16.compress(a)
    assert wire is a and ctx is None and Compression.fp16.decompress(wire, ctx) is a


def test_client_namespaces():
    torch = pytest.importorskip("torch")
    import ddl.torch as dt
    assert {"none", "fp16", "bf16"} <= set(vars(dt.Compression))
    wire, ctx = dt.Compression.bf16.compress(torch.ones(2))
    assert wire.dtype == torch.bfloat16 and dt.Compression.bf16.decompress(wire, ctx).dtype \
        == torch.float32
    assert dt.Compression.fp16.compress(torch.ones(2, dtype=torch.int64))[1] is None
