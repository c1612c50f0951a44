"""Cross-rank validation of one completed name, and the response it turns into.

:func:`validate` gets every submitting rank's :class:`Request` for one name of one
process set and returns either a :class:`pb.Error` (MISMATCH or INVALID, naming the op,
the tensor, two ranks and what each sent) or the template of the :class:`pb.Response`
every member will execute (without ``seq``; the leader assigns it).

Comparison is against the lowest-ranked submitter; the lowest disagreeing rank is
reported. Message formats are part of the contract (tests assert on them), e.g.
``allreduce 'grad/fc1': shape mismatch: rank 0 sent float32[17,17], rank 3 sent
float32[18,17]``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ddl.core.dtypes import describe, op_name, wire_name
from ddl.v1 import coordinator_pb2 as pb

REDUCE_NAMES: Dict[int, str] = {
    pb.SUM: "Sum", pb.AVERAGE: "Average", pb.MIN: "Min", pb.MAX: "Max",
    pb.PRODUCT: "Product", pb.ADASUM: "Adasum",
}
_FLOAT_DTYPES = frozenset({pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT64})
DATA_OPS = frozenset({pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL,
                      pb.REDUCESCATTER})
REDUCING_OPS = frozenset({pb.ALLREDUCE, pb.REDUCESCATTER})
DIM0_VARIES_OPS = frozenset({pb.ALLGATHER, pb.ALLTOALL})
NEEDS_DIM_OPS = frozenset({pb.ALLGATHER, pb.ALLTOALL, pb.REDUCESCATTER})
_VALID_DTYPES = frozenset(c for c in pb.DType.values() if c != pb.DTYPE_UNSPECIFIED)


def make_error(kind: int, message: str, *, op: str = "", name: str = "",
               rank_a: int = -1, value_a: str = "", rank_b: int = -1,
               value_b: str = "") -> pb.Error:
    """A :class:`pb.Error` with unset ranks as -1."""
    return pb.Error(kind=kind, message=message, op=op, name=name, rank_a=rank_a,
                    value_a=value_a, rank_b=rank_b, value_b=value_b, origin_rank=-1)


CLIP_CHARS = 200  # longest client-supplied string quoted in a status message
LOCAL_ERROR_CHARS = 1000  # longest Request.local_error (or error) quoted in an error message


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters (marked), for quoting what a client sent in
    a gRPC status, whose metadata must stay small."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def peer_lost_error(rank: int, host: str, pid: int, cause: str) -> pb.Error:
    """The PEER_LOST error every rank gets when ``rank`` is lost (same text everywhere)."""
    return pb.Error(kind=pb.PEER_LOST, rank_a=-1, rank_b=-1, origin_rank=rank,
                    origin_host=host, origin_pid=pid, cause=cause,
                    message=f"rank {rank} (host {host}, pid {pid}) was lost: {cause}")


def scale(req: pb.Request, field: str) -> float:
    """A request's pre/postscale factor (``field``); unset means 1.0."""
    return float(getattr(req, field)) if req.HasField(field) else 1.0


def _local_error(name: str, rank: int, req: pb.Request, n_members: int) -> Optional[pb.Error]:
    """What is wrong with one rank's request on its own, or None."""
    opn = op_name(req.op)

    def invalid(what: str, value: str) -> pb.Error:
        return make_error(pb.INVALID, f"{opn} '{name}': rank {rank} {what}", op=opn,
                          name=name, rank_a=rank, value_a=value)

    if req.op in DATA_OPS:
        if req.dtype not in _VALID_DTYPES:
            return invalid(f"sent unsupported dtype {wire_name(req.dtype)}",
                           wire_name(req.dtype))
        shape = list(req.shape)
        if any(d < 0 for d in shape):
            return invalid(f"sent a negative dimension in shape {shape}", str(shape))
        if req.op in NEEDS_DIM_OPS and not shape:
            return invalid(f"sent a 0-d array ({describe(req.dtype, shape)}); {opn} needs "
                           f"at least one dimension", describe(req.dtype, shape))
    if req.op in REDUCING_OPS:
        if req.reduce_op not in REDUCE_NAMES:
            return invalid(f"sent no reduce op (code {req.reduce_op}); use one of "
                           f"{', '.join(REDUCE_NAMES.values())}", str(req.reduce_op))
        if req.reduce_op == pb.ADASUM and req.op != pb.ALLREDUCE:
            return invalid("sent reduce op Adasum; Adasum is defined for allreduce only: "
                           "use allreduce, or Sum/Average here", "Adasum")
        if req.reduce_op == pb.ADASUM and req.dtype not in _FLOAT_DTYPES:
            return invalid(f"sent reduce op Adasum with dtype {wire_name(req.dtype)}; Adasum "
                           f"is defined on float16, bfloat16, float32 and float64 only: "
                           f"cast the tensor to a floating dtype, or use op=Sum or Average",
                           wire_name(req.dtype))
        if req.dtype == pb.BOOL and req.reduce_op not in (pb.MIN, pb.MAX):
            rop = REDUCE_NAMES[req.reduce_op]
            return invalid(f"sent reduce op {rop} with dtype bool; only Min (logical and) "
                           f"and Max (logical or) are defined on bool", rop)
    if req.op == pb.ALLTOALL:
        splits = list(req.splits)
        dim0 = req.shape[0]
        if not splits:
            if dim0 % n_members:
                return invalid(f"sent shape {describe(req.dtype, req.shape)} whose dim 0 "
                               f"({dim0}) does not divide evenly among {n_members} members; "
                               f"pass splits", str(dim0))
        elif (len(splits) != n_members or any(s < 0 for s in splits)
              or sum(splits) != dim0):
            return invalid(f"sent splits {splits} (sum {sum(splits)}) for dim 0 of {dim0}; "
                           f"splits must have {n_members} non-negative entries summing to "
                           f"dim 0", str(splits))
    return None


def _group(req: pb.Request) -> str:
    n = req.group_size
    return (f"a group of {n} array{'s' if n != 1 else ''}" if n
            else "one array (not a group)")


# (field name, applies to op, value shown in messages, comparison key)
_Field = Tuple[str, Callable[[int], bool], Callable[[pb.Request], str],
               Callable[[pb.Request], object]]
_FIELDS: List[_Field] = [
    ("op", lambda op: True, lambda r: op_name(r.op), lambda r: r.op),
    # before dtype and shape: the arrays of groups of other lengths pair up wrongly
    ("group size", lambda op: op in DATA_OPS, _group, lambda r: r.group_size),
    ("group names", lambda op: op in DATA_OPS, _group, lambda r: r.group_names),
    ("dtype", lambda op: op in DATA_OPS, lambda r: describe(r.dtype, r.shape),
     lambda r: r.dtype),
    ("shape", lambda op: op in DATA_OPS, lambda r: describe(r.dtype, r.shape),
     lambda r: tuple(r.shape[1:]) if r.op in DIM0_VARIES_OPS else tuple(r.shape)),
    ("reduce op", lambda op: op in REDUCING_OPS,
     lambda r: REDUCE_NAMES.get(r.reduce_op, str(r.reduce_op)), lambda r: r.reduce_op),
    ("memory", lambda op: op in DATA_OPS, lambda r: r.memory or "host",
     lambda r: r.memory or "host"),
    ("root rank", lambda op: op == pb.BROADCAST, lambda r: str(r.root_rank),
     lambda r: r.root_rank),
    ("prescale factor", lambda op: op in REDUCING_OPS,
     lambda r: repr(scale(r, "prescale_factor")),
     lambda r: scale(r, "prescale_factor")),
    ("postscale factor", lambda op: op in REDUCING_OPS,
     lambda r: repr(scale(r, "postscale_factor")),
     lambda r: scale(r, "postscale_factor")),
]


def _mismatch(name: str, base_rank: int, base: pb.Request, requests: Dict[int, pb.Request],
              fields: Sequence[_Field]) -> Optional[pb.Error]:
    opn = op_name(base.op)
    for rank in sorted(requests):
        if rank == base_rank:
            continue
        req = requests[rank]
        for field, applies, show, key in fields:
            if not applies(base.op) or key(req) == key(base):
                continue
            va, vb = show(base), show(req)
            prefix = f"'{name}'" if field == "op" else f"{opn} '{name}'"
            said = f"rank {base_rank} sent {va}, rank {rank} sent {vb}"
            if field == "group names":
                said = (f"ranks {base_rank} and {rank} sent groups of {base.group_size} "
                        f"arrays whose names differ (dicts with other keys, or pytrees of "
                        f"another structure): each rank must pass the same keys")
            return make_error(
                pb.MISMATCH, f"{prefix}: {field} mismatch: {said}",
                op=opn, name=name, rank_a=base_rank, value_a=va, rank_b=rank, value_b=vb)
    return None


def _alltoall_splits(req: pb.Request, n: int) -> List[int]:
    """Rows an alltoall request sends to each of the ``n`` members."""
    return list(req.splits) if req.splits else [req.shape[0] // n] * n


def _joined_error(name: str, process_set_id: int, base: pb.Request,
                  requests: Dict[int, pb.Request], joined: Sequence[int],
                  members: List[int]) -> Optional[pb.Error]:
    """What a call cannot do while ``joined`` members (that called ``ddl.join`` instead)
    take part, or None: a broadcast needs its root, and an alltoall cannot send rows to a
    joined rank (they would be lost)."""
    opn = op_name(base.op)
    waiting = sorted(requests)
    if base.op == pb.BROADCAST and base.root_rank in joined:
        root = base.root_rank
        return make_error(
            pb.INVALID,
            f"broadcast '{name}': root rank {root} has joined (called ddl.join) and sends "
            f"nothing; ranks {waiting} of process set {process_set_id} were waiting for it. "
            f"To fix this, broadcast from a rank that has not joined, or before the root "
            f"calls join", op=opn, name=name, rank_a=root, value_a="joined")
    if base.op == pb.ALLTOALL and joined:
        for rank in waiting:
            splits = _alltoall_splits(requests[rank], len(members))
            to_joined = [(j, splits[members.index(j)]) for j in joined
                         if splits[members.index(j)]]
            if to_joined:
                j, rows = to_joined[0]
                return make_error(
                    pb.INVALID,
                    f"alltoall '{name}': rank {rank} sent {rows} rows (splits {splits}) to "
                    f"rank {j}, which has joined (called ddl.join) and receives nothing; "
                    f"joined ranks: {list(joined)}. To fix this, pass splits with 0 rows for "
                    f"each joined rank", op=opn, name=name, rank_a=rank, value_a=str(splits),
                    rank_b=j, value_b="joined")
    return None


def validate(name: str, process_set_id: int, members: Sequence[int],
             requests: Dict[int, pb.Request],
             joined: Sequence[int] = ()) -> Union[pb.Error, pb.Response]:
    """Check one completed name; return its error or its response template.

    ``members`` are the sorted ranks of the process set, ``requests`` the submitters'
    requests by rank, ``joined`` the members that joined instead of submitting. A joined
    member takes part without data: neutral values in a reduction (allreduce,
    reducescatter; Average divides by the contributors only), zero rows in an allgather,
    nothing sent or received in an alltoall (rows addressed to it are an error), and in a
    broadcast it does not receive (a joined root is an error).
    """
    base_rank = min(requests)
    base = requests[base_rank]
    opn = op_name(base.op)
    err = _mismatch(name, base_rank, base, requests, _FIELDS[:1])  # op first
    if err is not None:
        return err
    for rank in sorted(requests):
        err = _local_error(name, rank, requests[rank], len(members))
        if err is not None:
            return err
    err = _mismatch(name, base_rank, base, requests, _FIELDS[1:])
    if err is not None:
        return err
    joined = sorted(joined)
    if base.op == pb.BROADCAST and base.root_rank not in members:
        return make_error(
            pb.INVALID,
            f"broadcast '{name}': root rank {base.root_rank} is not a member of process set "
            f"{process_set_id} (ranks {list(members)})",
            op=opn, name=name, rank_a=base_rank, value_a=str(base.root_rank))
    err = _joined_error(name, process_set_id, base, requests, joined, list(members))
    if err is not None:
        return err
    entry = pb.TensorEntry(name=name)
    if base.op in DATA_OPS:
        entry.shape.extend(base.shape)
    if base.op == pb.ALLGATHER:
        entry.first_dims.extend(requests[m].shape[0] if m in requests else 0 for m in members)
    elif base.op == pb.ALLTOALL:
        n = len(members)
        for m in members:  # a joined member sends nothing
            entry.splits.extend(_alltoall_splits(requests[m], n) if m in requests else [0] * n)
    resp = pb.Response(op=base.op, process_set_id=process_set_id, tensors=[entry],
                       prescale_factor=1.0, postscale_factor=1.0, joined_ranks=joined,
                       member_ranks=members, last_joined_rank=-1)
    if base.op in DATA_OPS:
        resp.dtype = base.dtype
        resp.memory = base.memory
    if base.op in REDUCING_OPS:
        resp.reduce_op = base.reduce_op
        resp.prescale_factor = scale(base, "prescale_factor")
        resp.postscale_factor = scale(base, "postscale_factor")
    if base.op == pb.BROADCAST:
        resp.root_rank = base.root_rank
    return resp
