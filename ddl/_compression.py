"""Gradient compression for the wire, one implementation for every framework client.

A compressor's ``compress(t)`` returns ``(wire_tensor, ctx)`` and ``decompress(wire, ctx)``
gives the tensor back in its original dtype. A cast compressor sends floating-point
tensors as its wire dtype (float16 or bfloat16) and leaves other tensors unchanged; the
framework part is only how to cast and how to tell a floating-point tensor, passed in by
the client (see :func:`compressions`). Cross-rank contract: every rank uses the same
compression for a name (the leader rejects mismatched dtypes).
"""

from __future__ import annotations

from typing import Any, Callable, Tuple


class Compressor:
    """No compression: the tensor travels as it is (``Compression.none``)."""

    name = "none"

    def compress(self, tensor: Any) -> Tuple[Any, Any]:
        return tensor, None

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return tensor

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype``; other tensors unchanged.

    ``cast(t, dtype)`` converts a framework tensor; ``is_floating(t)`` says whether it
    holds floating-point numbers. ``ctx`` is the original dtype, or None if not cast."""

    def __init__(self, name: str, wire_dtype: Any, cast: Callable[[Any, Any], Any],
                 is_floating: Callable[[Any], bool]):
        self.name, self.wire_dtype = name, wire_dtype
        self._cast, self._is_floating = cast, is_floating

    def compress(self, tensor: Any) -> Tuple[Any, Any]:
        if self._is_floating(tensor) and tensor.dtype != self.wire_dtype:
            return self._cast(tensor, self.wire_dtype), tensor.dtype
        return tensor, None

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else self._cast(tensor, ctx)


def compressions(cast: Callable[[Any, Any], Any], is_floating: Callable[[Any], bool],
                 **wire_dtypes: Any) -> type:
    """A client's ``Compression`` namespace: ``none`` plus one cast compressor per
    keyword, e.g. ``compressions(cast, is_floating, fp16=torch.float16)``."""
    members = {"none": Compressor(),
               "__doc__": "The compressions the collectives and optimizers accept: "
                          + ", ".join(["none", *wire_dtypes]) + "."}
    for name, dtype in wire_dtypes.items():
        members[name] = CastCompressor(name, dtype, cast, is_floating)
    return type("Compression", (), members)
