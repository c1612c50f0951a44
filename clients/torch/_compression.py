"""Gradient compression for the wire: what a tensor becomes before its allreduce.

``compress(t)`` returns ``(wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx)`` the
tensor in its original dtype. Every rank must use the same compression for a name (the
leader rejects mismatched dtypes).
"""

from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype``; others unchanged."""

    wire_dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant
    digits, and values above 65504 overflow)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range, about
    2 significant digits); reduced in float32 on the wire."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressions ``DistributedOptimizer`` and ``allreduce`` accept."""

    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
