"""The functional collectives.

Every collective here follows one contract:

* It is keyed by ``name``. Every member rank of the process set must make the call with
  the same name, op and parameters, and a compatible array (same dtype; same shape, or
  for ``allgather``/``alltoall`` the same shape after the first dimension). Ranks may
  submit different names in different orders: the leader orders them.
* If ``name`` is omitted, a name comes from a per-process counter (``allreduce.noname.N``),
  so every rank must then make its unnamed calls in the same order (name the calls the
  others make while a rank has joined: the joined rank's counters do not advance).
* The input is never modified. The result is a new array of the input's kind and dtype.
* A pytree (nested list/tuple/dict of arrays) is handled as one group and comes back
  with the same structure. Every member passes a group of the same length (each
  request carries it: another length is a :class:`~ddl.MismatchError` at the group's
  first name); a group's first error ends its call at once.
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

import hashlib
import threading
from typing import Any, Callable, List, NoReturn, Optional, Sequence

import numpy as np

from ddl import _args, _pytree
from ddl._process_sets import ProcessSet, global_process_set, resolve_call
from ddl._fast import lane as _fast_lane
from ddl.core import dtypes as _dtypes
from ddl.core.dtypes import ReduceOp
from ddl.core.errors import DDLError, InvalidRequestError
from ddl.runtime.device_arrays import DeviceArray
from ddl.runtime.engine import Entry
from ddl.runtime.handle import GroupHandle, Handle
from ddl.runtime.runtime import is_initialized, runtime
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


def _enqueue(op: int, x: Any, *, name: Optional[str], process_set: ProcessSet,
             reduce_op: Any = None, prescale: Any = 1.0, postscale: Any = 1.0,
             root_rank: Any = 0, splits: Any = None, one_array: bool = False,
             problem: str = "", wrap: Optional[Callable[[Any, Any], Any]] = None) -> Handle:
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
    _args.check_name(name)
    ps_id, members, ps_problem = resolve_call(process_set, rt.topology.rank)
    opname = _dtypes.op_name(op)
    base = name if name is not None else rt.names.next(opname, ps_id)
    timeout = rt.config.collective_timeout
    args = _args.Args(op, ps_id, members, x, reduce_op, prescale, postscale, root_rank,
                      splits, one_array, _blocking.timeout if _blocking.active else None)
    args.problem = problem or ps_problem or args.problem

    data = op not in (pb.BARRIER, pb.JOIN)
    if _pytree.is_tree(x) and not one_array:  # names as the others' (a bad call's too)
        leaves, paths, treedef = _pytree.flatten(x)
    else:
        leaves, paths, treedef = [x], [""], None
    if (data and isinstance(x, (list, tuple)) and x
            and all(_args.python_number(v) for v in leaves)):
        args.problem = _args.leaf_problem(opname, x, x, "")  # a list of numbers: one problem
        leaves, paths, treedef = [x], [""], None

    entries = [_leaf_entry(op, opname, x, leaf, f"{base}/{path}" if path else base, path,
                           ps_id, args, data, wrap, timeout)
               for leaf, path in zip(leaves, paths)]
    if treedef is not None and data:   # the others compare them (Request.group_size)
        names = _group_names(paths)
        for entry in entries:
            entry.request.group_size = len(entries)
            entry.request.group_names = names
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
    if treedef is None and len(entries) == 1:
        handle = entries[0].handle
    else:
        handle = GroupHandle(opname, base, timeout, [e.handle for e in entries],
                             lambda values: _pytree.unflatten(treedef, values),
                             lambda error, unfinished: rt.engine.abandon(
                                 [e for e in entries if e.handle in unfinished]))
    # a group that failed at one part stops running cycles for its cached others
    drive = rt.engine.submit(entries, inline=_blocking.on, done=lambda: handle._done,
                             group=base if treedef is not None else "")
    if bad:
        _raise_own(bad, rt.topology.rank, timeout)
    handle._drive = drive
    return handle


def _group_names(paths: List[str]) -> int:
    """Request.group_names of a group whose arrays have ``paths``."""
    digest = hashlib.blake2b("\0".join(paths).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _leaf_entry(op: int, opname: str, x: Any, leaf: Any, name: str, path: str, ps_id: int,
                args: _args.Args, data: bool, wrap: Optional[Callable[[Any, Any], Any]],
                timeout: float) -> Entry:
    """The Entry of one leaf of ``x``: its request carries what is wrong, if anything."""
    problem, array, wire, shape, splits, finish = args.problem, None, 0, (), None, _same
    memory = ""
    if data and not problem:
        problem = _args.leaf_problem(opname, x, leaf, path)
        if not problem:
            adapter, array, wire, memory, problem = _args.host_array(leaf)
        if array is not None:
            shape, splits = array.shape, args.splits
            if splits is not None:
                problem = _args.splits_problem(splits, shape)
            finish = _finisher(adapter, leaf, wrap, array)
    request = pb.Request(name=name, op=op, reduce_op=args.reduce_op,
                         prescale_factor=args.prescale, postscale_factor=args.postscale,
                         root_rank=args.root_rank, process_set_id=ps_id, dtype=wire,
                         shape=shape, splits=splits, local_error=problem, memory=memory)
    return Entry(request, array, Handle(opname, name, timeout), finish)


def _same(value: Any) -> Any:
    return value


def _finisher(adapter: Any, leaf: Any, wrap: Optional[Callable[[Any, Any], Any]],
              array: Any) -> Callable[[Any], Any]:
    """What turns the result of ``leaf`` (host, or on the device when ``array`` is a
    device view) into the user's value (see ``_enqueue``)."""
    if isinstance(array, DeviceArray):
        stream = array.caller

        def convert(value: Any) -> Any:
            return adapter.from_device(value, leaf, stream)
    else:
        def convert(value: Any) -> Any:
            return adapter.from_numpy(value, leaf)
    if wrap is not None:
        return lambda value: wrap(convert, value)
    return convert


def _fast(op: int, x: Any, name: Optional[str], process_set: ProcessSet,
          timeout: Optional[float], reduce_op: Any = None, prescale: Any = 1.0,
          postscale: Any = 1.0, root_rank: Any = 0, splits: Any = None,
          wrap: Optional[Callable[[Any, Any], Any]] = None) -> Any:
    """The blocking call's result through the fast lane (:mod:`ddl._fast`), or None: take
    the usual path. Only named calls on the global set with the default timeout qualify."""
    if name is None or timeout is not None or process_set is not global_process_set:
        return None
    rt = runtime()
    lane = _fast_lane(rt)
    if lane is None:
        return None
    # the arguments with their types: a key equal to another (1 and True, 1 and 1.0) must
    # not reuse a slot whose request the other made
    key = (op, name, reduce_op, type(reduce_op), prescale, type(prescale), postscale,
           type(postscale), root_rank, type(root_rank))
    if splits is not None:   # a list, tuple or NumPy array of ints; others (an iterator,
        # read once; tensors) take the usual path, which also says what is wrong
        if not isinstance(splits, (list, tuple, np.ndarray)) or np.ndim(splits) != 1:
            return None
        values = tuple(splits)
        kinds = tuple(map(type, values))
        if not all(issubclass(k, (int, np.integer)) for k in kinds):
            return None
        key += (type(splits), values, kinds)

    def build() -> pb.Request:  # the request the usual path makes of this call
        _args.check_name(name)
        ps_id, members, problem = resolve_call(process_set, rt.topology.rank)
        args = _args.Args(op, ps_id, members, x, reduce_op, prescale, postscale, root_rank,
                          splits, True, None)
        args.problem = problem or args.problem
        return _leaf_entry(op, _dtypes.op_name(op), x, x, name, "", ps_id, args, True, wrap,
                           rt.config.collective_timeout).request

    return lane.run(key, x, build, wrap)


def _raise_own(bad: List[Entry], rank: int, timeout: float) -> None:
    """Wait for the leader's answer to ``bad`` (at once: it fails them on every member),
    then raise this rank's own reason (the same text, unless another rank's bad call of
    the name reached the leader first)."""
    for entry in bad:
        try:
            entry.handle.wait(timeout)
        except InvalidRequestError:
            pass
    request = bad[0].request
    opname = _dtypes.op_name(request.op)
    raise InvalidRequestError(f"{opname} '{request.name}': rank {rank} "
                              f"{request.local_error}", op=opname, name=request.name)


def refuse(op: str, problem: str, error: BaseException, *, name: Optional[str] = None,
           process_set: ProcessSet = global_process_set, group: int = 0,
           keys: Sequence[str] = ()) -> NoReturn:
    """For a framework client whose collective ``op`` (``"allreduce"``, ...) was given
    something it cannot send (not its framework's tensor): submit the call's names with
    ``problem`` (what this rank passed, as it follows "rank N ") so that every member's
    call of them fails at once with :class:`~ddl.InvalidRequestError`, as for the
    core's own checks, then raise ``error`` here. The names are the ones the other
    members' call has: ``name`` (or the next unnamed one of ``op``); for a call of a
    ``group`` of that many arrays ``name/0`` ... (a group of unknown length: pass 1; the
    others' whole call fails at its first name); for a call of a dict of arrays under
    ``keys`` (a client's own group, such as a sparse allreduce's), ``name/key`` each."""
    if is_initialized():
        code = next(c for c in pb.OpType.values() if _dtypes.op_name(c) == op)
        what = ({key: None for key in keys} if keys else [None] * group if group else None)
        try:
            _enqueue(code, what, name=name, process_set=process_set,
                     one_array=what is None, problem=problem)
        except (DDLError, TypeError, ValueError):  # the others' error (expected),
            pass    # or a bad name or job: ``error`` is this rank's problem either way
    raise error


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
    ``Min`` (and) and ``Max`` (or) are allowed. ``op=Adasum`` (floating dtypes only) is
    not elementwise: each tensor (also in a group) combines as a whole, pairwise up a
    binary tree over the members (:class:`ReduceOp`); every rank receives every member's
    tensor, so it needs ``size`` times the tensor's memory.

    Example::

        ddl.init()
        total = ddl.allreduce(np.ones(3), name="ones", op=ddl.Sum)  # == ddl.size() * ones
        same = ddl.allreduce(np.ones(3), name="same", op=ddl.Adasum)  # == ones
    """
    out = _fast(pb.ALLREDUCE, x, name, process_set, timeout, op, prescale_factor,
                postscale_factor)
    if out is not None:
        return out
    with _blocking(timeout):
        handle = allreduce_async(x, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return handle.wait(timeout)


def _not_a_group(fn: str, op: int, xs: Any, **kw: Any) -> Optional[Handle]:
    """For a ``grouped_*`` call given something other than a list or tuple: the call,
    submitted as the first array of the group so that the others' calls of the group's
    first name fail at once, and with it their whole call (Request.call_id)."""
    if isinstance(xs, (list, tuple)):
        return None
    kind = f"{type(xs).__module__}.{type(xs).__qualname__}"
    return _enqueue(op, [None], problem=f"passed a {kind} to {fn}, which takes a list or "
                                        f"tuple of arrays (for one array, use "
                                        f"{fn[len('grouped_'):]})", **kw)


def grouped_allreduce_async(xs: Sequence[Any], name: Optional[str] = None,
                            op: ReduceOp = Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`grouped_allreduce`."""
    bad = _not_a_group("grouped_allreduce", pb.ALLREDUCE, xs, name=name,
                       process_set=process_set, reduce_op=op, prescale=prescale_factor,
                       postscale=postscale_factor)
    return bad or allreduce_async(list(xs), name, op, prescale_factor, postscale_factor,
                                  process_set)


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
    out = _fast(pb.ALLGATHER, x, name, process_set, timeout)
    if out is not None:
        return out
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
    out = _fast(pb.BROADCAST, x, name, process_set, timeout, root_rank=root_rank)
    if out is not None:
        return out
    with _blocking(timeout):
        handle = broadcast_async(x, root_rank, name, process_set)
    return handle.wait(timeout)


def alltoall_async(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`alltoall`."""
    return _enqueue(pb.ALLTOALL, x, name=name, process_set=process_set, splits=splits,
                    one_array=True, wrap=_alltoall_value)


def _alltoall_value(convert: Callable[[Any], Any], value: Any) -> Any:
    """An alltoall's ``(received, received_splits)``, ``received`` as the user's kind."""
    out, received = value
    return convert(out), received


def alltoall(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set, timeout: Optional[float] = None):
    """Send rows of ``x`` to every member; returns ``(received, received_splits)``.

    ``splits[j]`` rows (along dim 0, in order) go to the j-th member of the process set;
    without ``splits`` dim 0 is divided evenly. ``received`` concatenates what each member
    sent to this rank, in member order, and ``received_splits[j]`` is how many rows came
    from member j. Members agree on dtype and every dimension but the first.
    """
    out = _fast(pb.ALLTOALL, x, name, process_set, timeout, splits=splits,
                wrap=_alltoall_value)
    if out is not None:
        return out
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
    out = _fast(pb.REDUCESCATTER, x, name, process_set, timeout, op, prescale_factor,
                postscale_factor)
    if out is not None:
        return out
    with _blocking(timeout):
        handle = reducescatter_async(x, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return handle.wait(timeout)


def grouped_allgather_async(xs: Sequence[Any], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Asynchronous :func:`grouped_allgather`."""
    bad = _not_a_group("grouped_allgather", pb.ALLGATHER, xs, name=name,
                       process_set=process_set)
    return bad or allgather_async(list(xs), name, process_set)


def grouped_allgather(xs: Sequence[Any], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set,
                      timeout: Optional[float] = None) -> List[Any]:
    """Allgather a list of arrays as one group (one negotiation); a list of results.

    Same contract as :func:`allgather` for each element, position by position (dim 0 may
    differ per rank and per array)."""
    with _blocking(timeout):
        handle = grouped_allgather_async(xs, name, process_set)
    return handle.wait(timeout)


def grouped_reducescatter_async(xs: Sequence[Any], name: Optional[str] = None,
                                op: ReduceOp = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Asynchronous :func:`grouped_reducescatter`."""
    kw = dict(name=name, process_set=process_set, reduce_op=op, prescale=prescale_factor,
              postscale=postscale_factor)
    return (_not_a_group("grouped_reducescatter", pb.REDUCESCATTER, xs, **kw)
            or _enqueue(pb.REDUCESCATTER, list(xs), **kw))


def grouped_reducescatter(xs: Sequence[Any], name: Optional[str] = None,
                          op: ReduceOp = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          timeout: Optional[float] = None) -> List[Any]:
    """Reduce-scatter a list of arrays as one group (one negotiation); a list of results,
    each this member's block of dim 0 as :func:`reducescatter` gives it."""
    with _blocking(timeout):
        handle = grouped_reducescatter_async(xs, name, op, process_set, prescale_factor,
                                             postscale_factor)
    return handle.wait(timeout)


# -- synchronization -----------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set,
            timeout: Optional[float] = None) -> None:
    """Return once every member of ``process_set`` has called ``barrier``.

    Barriers of a set match in the order each rank calls them, under one fixed name (a
    barrier blocks, so a rank has one in flight per set): a rank that has joined counts
    as arrived at the others' barriers without calling them, and its next barrier still
    matches theirs. Two threads of one rank in barriers of the same set at once get
    :class:`~ddl.DuplicateNameError`."""
    with _blocking(timeout):
        handle = _enqueue(pb.BARRIER, None, name="barrier", process_set=process_set)
    handle.wait(timeout)


def join(timeout: Optional[float] = None,
         process_set: ProcessSet = global_process_set) -> int:
    """Say this rank has no more data for ``process_set``'s collectives; return once every
    member has joined, with the last member to join.

    Until then the others' collectives of that set (of every set, for the global set,
    which every rank belongs to) complete without this rank's data, which it still takes
    part in:

    * allreduce, reducescatter (grouped too): it contributes the neutral value of the
      reduce op (0 for Sum, 1 for Product, the dtype's extremes for Min and Max), and
      ``Average`` divides by the members that did not join; reducescatter still splits
      dim 0 among all members;
    * allgather: it contributes zero rows;
    * broadcast: it receives nothing; if the root has joined, every rank waiting on the
      broadcast raises :class:`InvalidRequestError` naming the root;
    * alltoall: it sends and receives nothing; the others must send it 0 rows (pass
      ``splits``), else each of them raises :class:`InvalidRequestError`;
    * barrier: it counts as arrived.

    Every member must call ``join`` on the same set; a later ``join`` starts a new round.
    Example, with uneven data per rank::

        for batch in my_batches:
            train_step(batch)        # allreduces gradients
        ddl.join()
    """
    with _blocking(timeout):
        handle = _enqueue(pb.JOIN, None, name="join", process_set=process_set)
    return handle.wait(timeout)


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result (same as ``handle.wait()``)."""
    return handle.wait(timeout)


def poll(handle: Handle) -> bool:
    """Whether ``handle`` has finished; never blocks."""
    return handle.poll()
