"""The functional collectives.

Every collective here follows one contract:

* It is keyed by ``name``. Every member rank of the process set must make the call with
  the same name, op and parameters, and a compatible array (same dtype; same shape, or
  for ``allgather``/``alltoall`` the same shape after the first dimension). Ranks may
  submit different names in different orders: the leader orders them.
* If ``name`` is omitted, a name comes from a per-process counter (``allreduce.noname.N``),
  so every rank must then make its unnamed calls in the same order.
* The input is never modified. The result is a new array of the input's kind and dtype.
* A pytree (nested list/tuple/dict of arrays) is handled as one group and comes back
  with the same structure.
* Each collective has an ``_async`` twin returning a :class:`~ddl.Handle`.
* An argument a rank cannot send (an unsupported dtype, a ``root_rank`` outside the
  process set, an unknown op, bad splits or scale factors or timeout) fails the call on
  every member at once: the rank still submits the name, with what was wrong
  (``Request.local_error``), and the leader answers every member with an
  :class:`~ddl.InvalidRequestError` naming that rank and the reason (raised at once by
  the rank itself, also from an ``_async`` form); the job stays usable. Only a bad
  ``name``, or a ``process_set`` that does not say which set is meant, raises on the
  calling rank alone, as the others' call cannot be told from it.
* Every blocking call waits at most ``timeout`` seconds (default
  ``DDL_COLLECTIVE_TIMEOUT_SECONDS``), then raises :class:`~ddl.DDLTimeoutError`; the
  collective stays in flight (its name stays taken) until the job completes or fails it.
  A failure of the job (a lost peer or coordinator, a stall) raises at once instead.

One generic path does the work: ``_enqueue`` builds the requests, submits them, and
returns a handle; the public functions are thin wrappers.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ddl import _adapters, _dtypes, _pytree
from ddl._dtypes import ReduceOp
from ddl._engine import Entry
from ddl._errors import InvalidRequestError
from ddl._handle import GroupHandle, Handle
from ddl._process_sets import ProcessSet, global_process_set, resolve_call
from ddl._runtime import runtime
from ddl.v1 import coordinator_pb2 as pb

Average = ReduceOp.Average


class _Blocking(threading.local):
    """Set while a blocking collective submits: its caller waits at once with the default
    timeout (``on``), so it may run a cached call's cycles itself (see ``Engine.submit``).
    ``timeout`` is what the caller will wait with, checked with the call's arguments."""

    on = False
    active = False
    timeout: Any = None

    def __call__(self, timeout: Any) -> "_Blocking":
        self.on = timeout is None
        self.active, self.timeout = True, timeout
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.on = self.active = False
        self.timeout = None


_blocking = _Blocking()


MAX_NAME_BYTES = 4096  # every response, error and timeline event carries the name


def _check_name(name: Any) -> None:
    """Raise on a name that cannot key a call (on this rank only: the other ranks' call
    cannot be told from it)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__} ({_show(name)})")
    if not name:
        raise ValueError("name must be a non-empty string, not ''")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"name {name!r} is not valid Unicode: {exc.reason} at index "
                         f"{exc.start} ({name[exc.start]!r}); names travel as UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"name {_show(name)} is {size} bytes long in UTF-8; names may have "
                         f"at most {MAX_NAME_BYTES}")


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for messages."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


_OPS_TEXT = "ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product"


def _check_op(op: Any) -> ReduceOp:
    """``op`` as a ReduceOp; ValueError naming the accepted ops otherwise."""
    if isinstance(op, bool) or not isinstance(op, (ReduceOp, int, np.integer)):
        raise ValueError(f"op must be one of {_OPS_TEXT}, not {_show(op)}")
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"op must be one of {_OPS_TEXT}, not {_show(op)}") from None


def _number_problem(what: str, value: Any) -> str:
    """Why ``value`` is no finite real number (bools excluded), or ""."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"passed {what}={_show(value)} ({type(value).__name__}); it must be a real number"
    if not math.isfinite(float(value)):
        return f"passed {what}={value!r}; it must be finite"
    return ""


def timeout_problem(timeout: Any) -> str:
    """Why ``timeout`` is no valid wait (None, or finite seconds >= 0), or ""."""
    if timeout is None:
        return ""
    problem = _number_problem("timeout", timeout)
    if not problem and timeout < 0:
        problem = f"passed timeout={timeout!r}; it must be >= 0 seconds (or None)"
    return problem


class _Args:
    """A call's arguments as the wire carries them, and the first thing wrong with them
    (``problem``: the text that follows "rank N " in the error every member gets)."""

    def __init__(self, op: int, ps_id: int, members: Tuple[int, ...], x: Any, reduce_op: Any,
                 prescale: Any, postscale: Any, root_rank: Any, splits: Any,
                 one_array: bool):
        self.reduce_op, self.prescale, self.postscale, self.root_rank = 0, 1.0, 1.0, 0
        self.splits: Optional[List[int]] = None
        self.problem = ""
        self.problem = (
            (timeout_problem(_blocking.timeout) if _blocking.active else "")
            or (reduce_op is not None and (
                self._reduce_op(reduce_op) or self._scale("prescale_factor", prescale)
                or self._scale("postscale_factor", postscale)))
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
            self.reduce_op = int(_check_op(op))
        except ValueError:
            return f"passed op={_show(op)}; op must be one of {_OPS_TEXT}"
        return ""

    def _scale(self, what: str, value: Any) -> str:
        if type(value) is float and math.isfinite(value):  # the usual case, fast
            setattr(self, what.split("_")[0], value)
            return ""
        problem = _number_problem(what, value)
        if not problem:
            setattr(self, what.split("_")[0], float(value))
        return problem

    def _root(self, root: Any, ps_id: int, members: Tuple[int, ...]) -> str:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            return f"passed root_rank={_show(root)} ({type(root).__name__}); it must be an int"
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
            return (f"passed splits={_show(splits)}; splits must be {n_members} ints, the "
                    f"rows sent to each member")
        self.splits = [int(s) for s in arr.reshape(-1)]
        if len(self.splits) != n_members or any(s < 0 for s in self.splits):
            return (f"passed splits {self.splits}; splits must have {n_members} non-negative "
                    f"entries (rows sent to each member)")
        return ""


def _ranks_text(members: Sequence[int]) -> str:
    """``0..3`` for a contiguous range of ranks, else the list."""
    members = list(members)
    if len(members) > 2 and members == list(range(members[0], members[-1] + 1)):
        return f"{members[0]}..{members[-1]}"
    return str(members)


_ARRAY_TEXT = ("an array (a NumPy array, or a framework tensor once its ddl client, e.g. "
               "ddl.torch, is imported) or a list, tuple or dict of arrays")


def _python_number(v: Any) -> bool:
    """A Python bool, int, float or complex (NumPy scalars, some of which subclass these,
    are arrays to ddl)."""
    return isinstance(v, (bool, int, float, complex)) and not isinstance(v, np.generic)


def _leaf_problem(opname: str, x: Any, leaf: Any, path: str) -> str:
    """Why ``leaf`` (of ``x``, at ``path``; ``x`` itself if ``path`` is empty) is no array
    ddl can send, or "".

    A list or tuple is a pytree (a group of arrays), never one array: a list of numbers
    is refused rather than guessed at, as ``[np.ones(2), np.ones(2)]`` and ``[1.0, 2.0]``
    would otherwise mean different things.
    """
    kind = type(x).__name__
    if leaf is None:
        return f"passed None; {opname} takes {_ARRAY_TEXT}"
    if isinstance(x, (list, tuple)) and not path:  # every leaf is a number
        return (f"passed a {kind} of Python numbers ({_show(x)}); ddl reads a {kind} as a "
                f"group of arrays: pass np.asarray({_show(x)}) to send it as one array")
    if _python_number(leaf) and not path:
        return (f"passed a Python {type(leaf).__name__} ({_show(leaf)}); {opname} takes "
                f"{_ARRAY_TEXT}: pass np.asarray({_show(leaf)})")
    if _python_number(leaf):
        return (f"passed a {kind} holding a Python {type(leaf).__name__} ({_show(leaf)}) at "
                f"'{path}', where an array is needed; pass np.asarray(...) instead")
    return ""


def _host_array(leaf: Any):
    """``(adapter, host array, "")`` for ``leaf``, or ``(None, None, problem)``."""
    kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
    try:
        adapter = _adapters.adapter_for(leaf)
    except TypeError:
        return None, None, (f"passed a {kind} ({_show(leaf)}); ddl collectives take "
                            f"{_ARRAY_TEXT}")
    try:
        array = adapter.to_numpy(leaf)
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, None, f"passed a {kind} that ddl cannot read: {exc}"
    if np.dtype(array.dtype) not in _dtypes.SUPPORTED_DTYPES:
        return None, None, (f"passed a {kind} of dtype {array.dtype}, which ddl does not "
                            f"support; supported dtypes: {_dtypes.SUPPORTED_NAMES}")
    return adapter, array, ""


def _enqueue(op: int, x: Any, *, name: Optional[str], process_set: ProcessSet,
             reduce_op: Any = None, prescale: Any = 1.0, postscale: Any = 1.0,
             root_rank: Any = 0, splits: Any = None, one_array: bool = False,
             problem: str = "", wrap: Optional[Callable[[Any, Any, Any], Any]] = None) -> Handle:
    """Submit one collective over ``x`` (an array, a pytree, or None) and return its handle.

    The arguments come as the user passed them (``reduce_op`` None: the op does not
    reduce; ``one_array``: ``x`` must not be a pytree; ``problem``: the caller found one
    already). If one is wrong, the name is still
    submitted, with the reason, so that every member fails at once (see the module doc);
    here the error is raised once the leader answers.
    ``wrap(adapter, like, host_result)`` turns a leaf's host result into the user's value;
    by default the adapter rebuilds an array of ``like``'s kind.
    """
    rt = runtime()
    _check_name(name)
    ps_id, members, ps_problem = resolve_call(process_set, rt.topology.rank)
    opname = _dtypes.op_name(op)
    base = name if name is not None else rt.names.next(opname, ps_id)
    timeout = rt.config.collective_timeout
    args = _Args(op, ps_id, members, x, reduce_op, prescale, postscale, root_rank, splits,
                 one_array)
    args.problem = problem or ps_problem or args.problem

    data = op not in (pb.BARRIER, pb.JOIN)
    if _pytree.is_tree(x) and not one_array:  # names as the others' (a bad call's too)
        leaves, paths, treedef = _pytree.flatten(x)
    else:
        leaves, paths, treedef = [x], [""], None
    if (data and isinstance(x, (list, tuple)) and x
            and all(_python_number(v) for v in leaves)):
        args.problem = _leaf_problem(opname, x, x, "")  # a list of numbers: one problem
        leaves, paths, treedef = [x], [""], None

    entries: List[Entry] = []
    for leaf, path in zip(leaves, paths):
        leaf_name = f"{base}/{path}" if path else base
        request = pb.Request(name=leaf_name, op=op, reduce_op=args.reduce_op,
                             prescale_factor=args.prescale, postscale_factor=args.postscale,
                             root_rank=args.root_rank, process_set_id=ps_id,
                             local_error=args.problem)
        array = None
        finish: Callable[[Any], Any] = lambda v: v
        if data and not args.problem:
            request.local_error = _leaf_problem(opname, x, leaf, path)
            adapter = None
            if not request.local_error:
                adapter, array, request.local_error = _host_array(leaf)
            if not request.local_error:
                request.dtype = _dtypes.to_wire(array.dtype)
                request.shape.extend(int(d) for d in array.shape)
                if args.splits is not None:
                    if sum(args.splits) != (array.shape[0] if array.ndim else -1):
                        request.local_error = (
                            f"passed splits {args.splits} (sum {sum(args.splits)}) for an "
                            f"array of shape {list(array.shape)}; splits must sum to dim 0")
                    request.splits.extend(args.splits)
                if wrap is not None:
                    finish = (lambda a, lf: lambda v: wrap(a, lf, v))(adapter, leaf)
                else:
                    finish = (lambda a, lf: lambda v: a.from_numpy(v, lf))(adapter, leaf)
        entries.append(Entry(request, array, Handle(opname, leaf_name, timeout), finish))

    if args.problem and not entries:  # an empty group: nothing for the others to wait on
        raise InvalidRequestError(f"{opname} '{base}': rank {rt.topology.rank} "
                                  f"{args.problem}", op=opname, name=base)
    bad = [e for e in entries if e.request.local_error]
    if bad and len(entries) > 1:  # the whole call fails, on every leaf, naming the bad one
        first = bad[0].request
        why = (first.local_error if args.problem else
               f"{first.local_error} (at '{first.name}' in this call)")
        for entry in entries:
            entry.request.local_error = why
        bad = entries
    drive = rt.engine.submit(entries, inline=_blocking.on)
    for entry in bad:  # the leader answers at once (with the first bad rank's reason)
        try:
            entry.handle.wait(timeout)
        except InvalidRequestError:
            pass
    if bad:  # this rank's own reason (the others' if it was the first)
        raise InvalidRequestError(
            f"{opname} '{bad[0].request.name}': rank {rt.topology.rank} "
            f"{bad[0].request.local_error}", op=opname, name=bad[0].request.name)
    if treedef is None and len(entries) == 1:
        handle = entries[0].handle
    else:
        handle = GroupHandle(opname, base, timeout, [e.handle for e in entries],
                             lambda values: _pytree.unflatten(treedef, values))
    handle._drive = drive
    return handle


# -- allreduce -----------------------------------------------------------------------------

def allreduce_async(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`allreduce`; ``handle.wait()`` returns its result."""
    return _enqueue(pb.ALLREDUCE, x, name=name, process_set=process_set, reduce_op=op,
                    prescale=prescale_factor, postscale=postscale_factor)


def allreduce(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set,
              timeout: Optional[float] = None) -> Any:
    """Reduce ``x`` elementwise across the ranks of ``process_set``; every rank gets the result.

    Every member must pass an array of the same dtype and shape under the same ``name``,
    with the same ``op`` and scale factors. The result is ``postscale * reduce(prescale *
    x)`` (``Average`` divides by the number of contributing ranks), a new array of ``x``'s
    kind and dtype; ``x`` is not modified. bfloat16 is reduced in float32; on bool only
    ``Min`` (and) and ``Max`` (or) are allowed.

    Example::

        ddl.init()
        total = ddl.allreduce(np.ones(3), name="ones", op=ddl.Sum)  # == ddl.size() * ones
    """
    with _blocking(timeout):
        handle = allreduce_async(x, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return handle.wait(timeout)


def grouped_allreduce_async(xs: Sequence[Any], name: Optional[str] = None,
                            op: ReduceOp = Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`grouped_allreduce`."""
    if not isinstance(xs, (list, tuple)):
        # submitted as the first array of the group: the others' calls of the group's
        # first name fail at once (what the others' further names are, cannot be known)
        kind = f"{type(xs).__module__}.{type(xs).__qualname__}"
        return _enqueue(pb.ALLREDUCE, [None], name=name, process_set=process_set,
                        reduce_op=op, prescale=prescale_factor, postscale=postscale_factor,
                        problem=f"passed a {kind} to grouped_allreduce, which takes a list "
                                f"or tuple of arrays (for one array, use allreduce)")
    return allreduce_async(list(xs), name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce(xs: Sequence[Any], name: Optional[str] = None, op: ReduceOp = Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      timeout: Optional[float] = None) -> List[Any]:
    """Allreduce a list of arrays as one fused group; returns a list of results.

    Same contract as :func:`allreduce` for each element; every rank passes the same number
    of arrays, with matching dtypes and shapes position by position.
    """
    with _blocking(timeout):
        handle = grouped_allreduce_async(xs, name, op, prescale_factor,
                                         postscale_factor, process_set)
    return handle.wait(timeout)


# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------

def allgather_async(x: Any, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`allgather`."""
    return _enqueue(pb.ALLGATHER, x, name=name, process_set=process_set)


def allgather(x: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              timeout: Optional[float] = None) -> Any:
    """Concatenate every member's ``x`` along the first dimension, in rank order.

    Members must agree on the dtype and on every dimension but the first, which may differ
    per rank. ``x`` must have at least one dimension. Every rank gets the whole result.

    Example::

        rows = ddl.allgather(np.full((ddl.rank() + 1, 2), ddl.rank()), name="rows")
    """
    with _blocking(timeout):
        handle = allgather_async(x, name, process_set)
    return handle.wait(timeout)


def broadcast_async(x: Any, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`broadcast`."""
    return _enqueue(pb.BROADCAST, x, name=name, process_set=process_set, root_rank=root_rank)


def broadcast(x: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              timeout: Optional[float] = None) -> Any:
    """Every member gets a copy of ``root_rank``'s ``x``.

    ``root_rank`` is a global rank and must be a member of ``process_set``. Every member
    passes an array of the same dtype and shape (non-roots' values are ignored).

    Example::

        weights = ddl.broadcast(weights, root_rank=0, name="init/w")
    """
    with _blocking(timeout):
        handle = broadcast_async(x, root_rank, name, process_set)
    return handle.wait(timeout)


def alltoall_async(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`alltoall`."""
    def wrap(adapter, like, value):
        out, received = value
        return adapter.from_numpy(out, like), received

    return _enqueue(pb.ALLTOALL, x, name=name, process_set=process_set, splits=splits,
                    one_array=True, wrap=wrap)


def alltoall(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set, timeout: Optional[float] = None):
    """Send rows of ``x`` to every member; returns ``(received, received_splits)``.

    ``splits[j]`` rows (along dim 0, in order) go to the j-th member of the process set;
    without ``splits`` dim 0 is divided evenly. ``received`` concatenates what each member
    sent to this rank, in member order, and ``received_splits[j]`` is how many rows came
    from member j. Members agree on dtype and every dimension but the first.
    """
    with _blocking(timeout):
        handle = alltoall_async(x, splits, name, process_set)
    return handle.wait(timeout)


def reducescatter_async(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Asynchronous :func:`reducescatter`."""
    return _enqueue(pb.REDUCESCATTER, x, name=name, process_set=process_set, reduce_op=op,
                    prescale=prescale_factor, postscale=postscale_factor, one_array=True)


def reducescatter(x: Any, name: Optional[str] = None, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  timeout: Optional[float] = None) -> Any:
    """Reduce ``x`` across members, then member i keeps block i of dim 0.

    Dim 0 is split as evenly as possible; earlier members get one extra row when it does
    not divide. Members pass the same dtype and shape (at least one dimension).
    """
    with _blocking(timeout):
        handle = reducescatter_async(x, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return handle.wait(timeout)


def _enqueue_membership(op: int, ps: ProcessSet) -> Handle:
    """Submit an ADD/REMOVE_PROCESS_SET agreement among ``ps``'s members."""
    rt = runtime()
    opname = _dtypes.op_name(op)
    ranks = ",".join(str(r) for r in ps.ranks)
    if op == pb.ADD_PROCESS_SET:
        request = pb.Request(name=f"{opname}/{ranks}", op=op, process_set_id=0,
                             member_ranks=list(ps.ranks))
    else:
        request = pb.Request(name=f"{opname}/{ps.process_set_id}", op=op,
                             process_set_id=ps.process_set_id)
    handle = Handle(opname, request.name, rt.config.collective_timeout)
    rt.engine.submit([Entry(request, None, handle)])
    return handle


# -- synchronization -----------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set,
            timeout: Optional[float] = None) -> None:
    """Return once every member of ``process_set`` has called ``barrier``."""
    with _blocking(timeout):
        handle = _enqueue(pb.BARRIER, None, name=None, process_set=process_set)
    handle.wait(timeout)


def join(timeout: Optional[float] = None) -> int:
    """Say this rank has no more data; returns the last rank to join.

    Until every rank has joined, this rank keeps taking part in other ranks' allreduces
    and allgathers with neutral values (zero rows for allgather), and is not counted by
    ``Average``. Global process set only.
    """
    with _blocking(timeout):
        handle = _enqueue(pb.JOIN, None, name="join", process_set=global_process_set)
    return handle.wait(timeout)


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result (same as ``handle.wait()``)."""
    return handle.wait(timeout)


def poll(handle: Handle) -> bool:
    """Whether ``handle`` has finished; never blocks."""
    return handle.poll()
