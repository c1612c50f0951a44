"""``ddl.tensorflow.Compression``: the core compressors (ddl._compression) with
TensorFlow's cast."""

from __future__ import annotations

import tensorflow as tf

from ddl._client_api import compressions

Compression = compressions(tf.cast, lambda t: t.dtype.is_floating,
                           fp16=tf.float16, bf16=tf.bfloat16)
