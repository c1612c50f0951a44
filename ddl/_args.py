"""A collective call's arguments: each check, and the words for what is wrong.

What only the calling rank can see (an array it cannot send, an op, scale factor,
root_rank, splits or timeout it cannot use) is described, not raised: the text follows
"rank N " in the InvalidRequestError every member of the call raises (see ``ddl._api``).
A name or a process set that cannot key a call is raised on the calling rank at once.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ddl import _adapters, _pytree
from ddl.core import dtypes as _dtypes
from ddl.core.dtypes import ReduceOp
from ddl.v1 import coordinator_pb2 as pb

MAX_NAME_BYTES = 4096  # every response, error and timeline event carries the name


def check_name(name: Any) -> None:
    """Raise on a name that cannot key a call (on this rank only: the other ranks' call
    cannot be told from it)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__} ({show(name)})")
    if not name:
        raise ValueError("name must be a non-empty string, not ''")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"name {name!r} is not valid Unicode: {exc.reason} at index "
                         f"{exc.start} ({name[exc.start]!r}); names travel as UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"name {show(name)} is {size} bytes long in UTF-8; names may have "
                         f"at most {MAX_NAME_BYTES}")


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for messages."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


_OPS_TEXT = "ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product"


def check_op(op: Any) -> ReduceOp:
    """``op`` as a ReduceOp; ValueError naming the accepted ops otherwise."""
    if isinstance(op, bool) or not isinstance(op, (ReduceOp, int, np.integer)):
        raise ValueError(f"op must be one of {_OPS_TEXT}, not {show(op)}")
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"op must be one of {_OPS_TEXT}, not {show(op)}") from None


def _number_problem(what: str, value: Any) -> str:
    """Why ``value`` is no finite real number (bools excluded), or ""."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"passed {what}={show(value)} ({type(value).__name__}); it must be a real number"
    if not math.isfinite(float(value)):
        return f"passed {what}={value!r}; it must be finite"
    return ""


def _real(what: str, value: Any) -> Tuple[float, str]:
    """``(float(value), "")`` for a finite real number, else ``(1.0, why not)``."""
    if type(value) is float and math.isfinite(value):  # the usual case, fast
        return value, ""
    problem = _number_problem(what, value)
    return (1.0, problem) if problem else (float(value), "")


def timeout_problem(timeout: Any) -> str:
    """Why ``timeout`` is no valid wait (None, or finite seconds >= 0), or ""."""
    if timeout is None:
        return ""
    problem = _number_problem("timeout", timeout)
    if not problem and timeout < 0:
        problem = f"passed timeout={timeout!r}; it must be >= 0 seconds (or None)"
    return problem


class Args:
    """A call's arguments as the wire carries them, and the first thing wrong with them
    (``problem``: the text that follows "rank N " in the error every member gets)."""

    def __init__(self, op: int, ps_id: int, members: Tuple[int, ...], x: Any, reduce_op: Any,
                 prescale: Any, postscale: Any, root_rank: Any, splits: Any,
                 one_array: bool, timeout: Any = None):
        self.reduce_op, self.prescale, self.postscale, self.root_rank = 0, 1.0, 1.0, 0
        self.splits: Optional[List[int]] = None
        self.problem = ""
        self.problem = (
            timeout_problem(timeout)
            or (reduce_op is not None and (
                self._reduce_op(reduce_op) or self._scales(prescale, postscale)))
            or (op == pb.BROADCAST and self._root(root_rank, ps_id, members))
            or (one_array and _pytree.is_tree(x)
                and f"passed a {type(x).__name__}; {_dtypes.op_name(op)} takes one array, "
                    f"not a pytree")
            or (op == pb.ALLTOALL and splits is not None
                and self._splits(splits, len(members)))
            or "")

    def _reduce_op(self, op: Any) -> str:
        if type(op) is ReduceOp:  # the usual case, fast
            self.reduce_op = int(op)
            return ""
        try:
            self.reduce_op = int(check_op(op))
        except ValueError:
            return f"passed op={show(op)}; op must be one of {_OPS_TEXT}"
        return ""

    def _scales(self, prescale: Any, postscale: Any) -> str:
        self.prescale, problem = _real("prescale_factor", prescale)
        if not problem:
            self.postscale, problem = _real("postscale_factor", postscale)
        return problem

    def _root(self, root: Any, ps_id: int, members: Tuple[int, ...]) -> str:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            return f"passed root_rank={show(root)} ({type(root).__name__}); it must be an int"
        if int(root) not in members:
            return (f"passed root_rank={int(root)}, but process set {ps_id} has ranks "
                    f"{_ranks_text(members)}")
        self.root_rank = int(root)
        return ""

    def _splits(self, splits: Any, n_members: int) -> str:
        try:
            arr = np.asarray(splits)
        except Exception:  # a ragged or odd sequence: named below
            arr = np.asarray([None])
        if arr.dtype.kind not in "iu" or arr.ndim > 1:
            return (f"passed splits={show(splits)}; splits must be {n_members} ints, the "
                    f"rows sent to each member")
        self.splits = [int(s) for s in arr.reshape(-1)]
        if len(self.splits) != n_members or any(s < 0 for s in self.splits):
            return (f"passed splits {self.splits}; splits must have {n_members} non-negative "
                    f"entries (rows sent to each member)")
        return ""


def splits_problem(splits: List[int], shape: Tuple[int, ...]) -> str:
    """Why ``splits`` (checked by :class:`Args`) do not fit an array of ``shape``, or ""."""
    if sum(splits) == (shape[0] if shape else -1):
        return ""
    return (f"passed splits {splits} (sum {sum(splits)}) for an array of shape "
            f"{list(shape)}; splits must sum to dim 0")


def _ranks_text(members: Sequence[int]) -> str:
    """``0..3`` for a contiguous range of ranks, else the list."""
    members = list(members)
    if len(members) > 2 and members == list(range(members[0], members[-1] + 1)):
        return f"{members[0]}..{members[-1]}"
    return str(members)


_ARRAY_TEXT = ("an array (a NumPy array, or a framework tensor once its ddl client, e.g. "
               "ddl.torch, is imported) or a list, tuple or dict of arrays")


def python_number(v: Any) -> bool:
    """A Python bool, int, float or complex (NumPy scalars, some of which subclass these,
    are arrays to ddl)."""
    return isinstance(v, (bool, int, float, complex)) and not isinstance(v, np.generic)


def leaf_problem(opname: str, x: Any, leaf: Any, path: str) -> str:
    """Why ``leaf`` (of ``x``, at ``path``; ``x`` itself if ``path`` is empty) is no array
    ddl can send, or "".

    A list or tuple is a pytree (a group of arrays), never one array: a list of numbers
    is refused rather than guessed at, as ``[np.ones(2), np.ones(2)]`` and ``[1.0, 2.0]``
    would otherwise mean different things.
    """
    if leaf is None:
        return f"passed None; {opname} takes {_ARRAY_TEXT}"
    if isinstance(x, (list, tuple)) and not path:  # every leaf is a number
        kind = type(x).__name__
        return (f"passed a {kind} of Python numbers ({show(x)}); ddl reads a {kind} as a "
                f"group of arrays: pass np.asarray({show(x)}) to send it as one array")
    if not python_number(leaf):
        return ""
    if not path:
        return (f"passed a Python {type(leaf).__name__} ({show(leaf)}); {opname} takes "
                f"{_ARRAY_TEXT}: pass np.asarray({show(leaf)})")
    return (f"passed a {type(x).__name__} holding a Python {type(leaf).__name__} "
            f"({show(leaf)}) at '{path}', where an array is needed; pass np.asarray(...) "
            f"instead")


def host_array(leaf: Any):
    """``(adapter, array, wire dtype code, memory, "")`` for ``leaf`` (``memory``: where
    its bytes live, :meth:`ddl.ArrayAdapter.memory`; ``array``: a host NumPy array, or a
    ``DeviceArray`` where the device data plane serves it), or
    ``(None, None, 0, "", problem)``."""
    try:
        adapter = _adapters.adapter_for(leaf)
    except TypeError:
        return None, None, 0, "", (f"passed a {_kind(leaf)} ({show(leaf)}); ddl "
                                   f"collectives take {_ARRAY_TEXT}")
    memory = adapter.memory(leaf)
    try:
        array = None
        if memory == "cuda" and _adapters.device_plane():
            array = adapter.to_device(leaf)   # stays on the device (None: staged)
        if array is None:
            array = adapter.to_numpy(leaf)
            _adapters.note_staged(memory)
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, None, 0, "", f"passed a {_kind(leaf)} that ddl cannot read: {exc}"
    wire = _dtypes.wire_code(array.dtype)
    if wire is None:
        return None, None, 0, "", (f"passed a {_kind(leaf)} of dtype {array.dtype}, which "
                                   f"ddl does not support; supported dtypes: "
                                   f"{_dtypes.SUPPORTED_NAMES}")
    return adapter, array, wire, memory, ""


def _kind(value: Any) -> str:
    """``value``'s type as ``module.Name``, for messages."""
    return f"{type(value).__module__}.{type(value).__qualname__}"
