"""``ddl.torch.Compression``: the core compressors (ddl._compression) with torch's cast."""

from __future__ import annotations

import torch

from ddl._client_api import compressions

Compression = compressions(lambda t, dtype: t.to(dtype),
                           lambda t: t.dtype.is_floating_point,
                           fp16=torch.float16, bf16=torch.bfloat16)
