"""ddl.keras: ddl for Keras 3 on the TensorFlow backend (``tf.keras`` is the same Keras).

    import keras, ddl.keras as ddl
    ddl.init()
    opt = ddl.DistributedOptimizer(keras.optimizers.Adadelta(1.0 * ddl.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[ddl.callbacks.BroadcastGlobalVariablesCallback(0)])

Importing ``ddl`` never imports Keras or TensorFlow; this module needs them
(``pip install 'ddl-train[tensorflow]'``).
"""

from __future__ import annotations

import json
import types
import zipfile

try:
    import keras as _keras
    import tensorflow as _tf  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ddl.keras needs Keras 3 and TensorFlow: pip install "
                      "'tensorflow>=2.21,<2.22' 'keras>=3.15,<4' (in a ddl checkout: pip "
                      "install -e '.[tensorflow]')") from exc

from ddl import _common_api
from ddl._common_api import *  # noqa: F401,F403  (the framework-neutral API, as in ddl)
from ddl.keras._ops import allgather, allreduce, broadcast, reducescatter
from ddl.tensorflow import Compression

from ddl.keras import callbacks, elastic
from ddl.tensorflow._keras_optimizer import DistributedOptimizer, PartialDistributedOptimizer


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, compile: bool = True, **kwargs):
    """``keras.models.load_model``, with the saved optimizer made distributed again, as
    Horovod's: ``custom_optimizers`` (optimizer classes of your own) and
    ``custom_objects`` let Keras rebuild what it saved; ``compression`` and ``kwargs``
    are the DistributedOptimizer's settings. As in Horovod (Keras 2), a function in
    ``custom_objects`` under the saved optimizer's name is called with its config
    (``{"MyOpt": lambda **kw: hvd.DistributedOptimizer(MyOpt(**kw))}``); an optimizer it
    made distributed already keeps its own settings."""
    custom_objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        custom_objects.setdefault(cls.__name__, cls)
    name = _saved_optimizer_name(filepath)
    factory = custom_objects.get(name)
    if isinstance(factory, types.FunctionType):
        # Keras 3 hands back a function found for a class as it is (not called)
        custom_objects[name] = type(name, (), {"from_config": staticmethod(
            lambda config: factory(**config))})
    model = _keras.models.load_model(filepath, custom_objects=custom_objects or None,
                                     compile=compile)
    kwargs["compression"] = compression
    optimizer = getattr(model, "optimizer", None) if compile else None
    if optimizer is not None and not getattr(optimizer, "_ddl_wrapped", False):
        DistributedOptimizer(optimizer, **kwargs)
    return model


def broadcast_global_variables(root_rank: int = 0):
    """Horovod's Keras ``broadcast_global_variables``: Keras 3 has no global variables
    (no session, no collection), so this raises ``RuntimeError`` saying what to use, as
    Horovod's does under TensorFlow 2."""
    raise RuntimeError(
        f"ddl.keras.broadcast_global_variables({root_rank}): Keras 3 keeps no global "
        f"variables to broadcast. In model.fit pass callbacks="
        f"[ddl.keras.callbacks.BroadcastGlobalVariablesCallback({root_rank})]; in a loop "
        f"of your own call ddl.tensorflow.broadcast_variables(model.variables, "
        f"{root_rank}) and the same for optimizer.variables once they exist")


def _saved_optimizer_name(filepath):
    """The name the saved optimizer's class is looked up by, in a ``.keras`` file (None
    if there is none, or the file is of another kind)."""
    try:
        with zipfile.ZipFile(filepath) as archive:
            config = json.loads(archive.read("config.json"))
        optimizer = config["compile_config"]["optimizer"]
        return optimizer.get("registered_name") or optimizer["class_name"]
    except (AttributeError, OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile):
        return None


__all__ = [
    *_common_api.__all__,
    # collectives, with Horovod's Keras signatures (ddl.tensorflow has them all)
    "allreduce", "allgather", "broadcast", "reducescatter",
    # training
    "DistributedOptimizer", "PartialDistributedOptimizer", "Compression", "callbacks",
    "elastic", "load_model", "broadcast_global_variables",
]
