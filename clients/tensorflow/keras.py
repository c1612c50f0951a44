"""``ddl.tensorflow.keras``: the same module as :mod:`ddl.keras`, under the path that
Horovod's ``horovod.tensorflow.keras`` takes when a script's imports are renamed
mechanically (``ddl.tensorflow.keras.callbacks`` and ``.elastic`` too)."""

import sys

import ddl.keras as _keras

sys.modules[__name__] = _keras
sys.modules[f"{__name__}.callbacks"] = _keras.callbacks
sys.modules[f"{__name__}.elastic"] = _keras.elastic
