"""Minimal pytrees: nested lists, tuples and dicts of arrays.

Dict keys are visited in sorted order so that every rank flattens the same structure to
the same leaf order.
"""

from __future__ import annotations

from typing import Any, List, Tuple

Leaf = Any


def is_tree(x: Any) -> bool:
    return isinstance(x, (list, tuple, dict))


def flatten(tree: Any) -> Tuple[List[Leaf], List[str], Any]:
    """``(leaves, paths, treedef)``; ``paths`` are stable strings such as ``"a/0"``."""
    leaves: List[Leaf] = []
    paths: List[str] = []

    def walk(node: Any, path: str):
        if isinstance(node, dict):
            keys = sorted(node, key=str)
            return ("dict", keys, [walk(node[k], f"{path}/{k}" if path else str(k)) for k in keys])
        if isinstance(node, (list, tuple)):
            kind = type(node)
            return (kind, None, [walk(v, f"{path}/{i}" if path else str(i))
                                 for i, v in enumerate(node)])
        leaves.append(node)
        paths.append(path)
        return None

    treedef = walk(tree, "")
    return leaves, paths, treedef


def unflatten(treedef: Any, leaves: List[Leaf]) -> Any:
    """Inverse of :func:`flatten`."""
    it = iter(leaves)

    def build(node: Any):
        if node is None:
            return next(it)
        kind, keys, children = node
        if kind == "dict":
            return {k: build(c) for k, c in zip(keys, children)}
        values = [build(c) for c in children]
        if kind is list:
            return values
        if kind is tuple:
            return tuple(values)
        try:  # namedtuple
            return kind(*values)
        except TypeError:
            return kind(values)

    return build(treedef)
