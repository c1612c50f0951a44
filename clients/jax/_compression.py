"""``ddl.jax.Compression``: the core compressors (ddl._compression) with JAX's cast; works
on concrete and traced arrays alike (the cast is part of a jitted step)."""

from __future__ import annotations

import jax.numpy as jnp

from ddl._client_api import compressions

Compression = compressions(lambda x, dtype: x.astype(dtype),
                           lambda x: jnp.issubdtype(x.dtype, jnp.floating),
                           fp16=jnp.float16, bf16=jnp.bfloat16)
