"""Per-layer trainable parameters and forward FLOPs of the benchmark models, read from
``keras.applications`` (weights not downloaded), written to docs/scaling/profiles.json.

FLOPs count a multiply-add as 2: a convolution costs 2·H_out·W_out·k_h·k_w·C_in·C_out
(depthwise: C_out = the multiplier), a dense layer 2·inputs·outputs; other layers are
taken as free. Needs TensorFlow (``pip install -e '.[tensorflow]'``); the JSON is
committed, so the model and its test do not.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

# name -> (keras.applications constructor, input side)
MODELS = {
    "inception_v3": ("InceptionV3", 299),
    "resnet50": ("ResNet50", 224),
    "resnet101": ("ResNet101", 224),
    "resnet152": ("ResNet152", 224),
    "vgg16": ("VGG16", 224),
}


def _layers(model) -> List[Tuple[int, float]]:
    rows = []
    for layer in model.layers:
        params = sum(int(w.numpy().size) for w in layer.trainable_weights)
        kind, flops = type(layer).__name__, 0.0
        if kind in ("Conv2D", "DepthwiseConv2D"):
            out, k = layer.output.shape, layer.kernel.shape
            flops = 2.0 * out[1] * out[2] * k[0] * k[1] * k[2] * k[3]
        elif kind == "Dense":
            k = layer.kernel.shape
            flops = 2.0 * k[0] * k[1]
        if params or flops:
            rows.append((params, flops))
    return rows


def build() -> Dict[str, List[Tuple[int, float]]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    out = {}
    for name, (ctor, side) in MODELS.items():
        model = getattr(keras.applications, ctor)(weights=None, input_shape=(side, side, 3))
        out[name] = _layers(model)
        keras.backend.clear_session()
    return out


def load(path: str) -> Dict[str, Tuple[Tuple[int, float], ...]]:
    with open(path) as f:
        return {k: tuple((int(p), float(fl)) for p, fl in v) for k, v in json.load(f).items()}


def write(path: str) -> None:
    with open(path, "w") as f:
        json.dump(build(), f, separators=(",", ":"))
        f.write("\n")
