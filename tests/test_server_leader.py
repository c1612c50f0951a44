"""Pure-logic tests of the leader: validation messages, order, fusion, process sets, join,
stalls and departures. No gRPC here; see test_server_grpc.py for the server."""

from __future__ import annotations

from typing import Dict, List

import pytest

from ddl.server.leader import Leader
from ddl.server.topology import compute_topology
from ddl.v1 import coordinator_pb2 as pb

from _grpc_client import req

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def responses(deliveries) -> Dict[int, List[pb.Response]]:
    """The responses of ``deliveries`` by rank; departure notices are skipped."""
    out: Dict[int, List[pb.Response]] = {}
    for rank, msg in deliveries:
        if msg.WhichOneof("kind") == "warning" and msg.warning.kind == pb.PEER_LOST:
            continue
        assert msg.WhichOneof("kind") == "responses", msg
        out.setdefault(rank, []).extend(msg.responses.responses)
    return out


def run(leader: Leader, *subs) -> Dict[int, List[pb.Response]]:
    """Submit ``(rank, request...)`` tuples in order; merged responses by rank."""
    merged: Dict[int, List[pb.Response]] = {}
    for rank, *requests in subs:
        for r, resps in responses(leader.submit(rank, requests)).items():
            merged.setdefault(r, []).extend(resps)
    return merged


def only_error(out, ranks) -> pb.Error:
    assert sorted(out) == sorted(ranks), out
    errs = {r: out[r][0].error for r in ranks}
    first = errs[ranks[0]]
    assert all(e == first for e in errs.values())
    return first


# -- topology --------------------------------------------------------------------------
def test_topology_uneven_hosts():
    topo = compute_topology(["h1", "h1", "h1", "h2"])
    assert (topo[3].local_rank, topo[3].local_size, topo[3].cross_rank,
            topo[3].cross_size) == (0, 1, 1, 2)
    assert (topo[1].local_rank, topo[1].local_size, topo[1].cross_rank,
            topo[1].cross_size) == (1, 3, 0, 1)
    assert not topo[0].is_homogeneous


def test_topology_interleaved_homogeneous():
    topo = compute_topology(["b", "a", "b", "a"])  # host b first: it has rank 0
    assert [(t.local_rank, t.cross_rank, t.cross_size) for t in topo] == [
        (0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert all(t.is_homogeneous and t.local_size == 2 for t in topo)


# -- validation messages ---------------------------------------------------------------
MISMATCHES = [
    (dict(shape=(17, 17)), dict(shape=(18, 17)), "grad/fc1", 3, pb.MISMATCH,
     "allreduce 'grad/fc1': shape mismatch: rank 0 sent float32[17,17], "
     "rank 3 sent float32[18,17]"),
    (dict(), dict(dtype=pb.INT32), "x", 1, pb.MISMATCH,
     "allreduce 'x': dtype mismatch: rank 0 sent float32[4], rank 1 sent int32[4]"),
    (dict(group_size=3), dict(group_size=2, shape=(5,)), "g/0", 1, pb.MISMATCH,  # first
     "allreduce 'g/0': group size mismatch: rank 0 sent a group of 3 arrays, rank 1 sent "
     "a group of 2 arrays"),
    (dict(group_size=1), dict(), "g", 1, pb.MISMATCH,
     "allreduce 'g': group size mismatch: rank 0 sent a group of 1 array, rank 1 sent one "
     "array (not a group)"),
    (dict(group_size=2, group_names=7), dict(group_size=2, group_names=9), "g/a", 1,
     pb.MISMATCH, "allreduce 'g/a': group names mismatch: ranks 0 and 1 sent groups of 2 "
     "arrays whose names differ (dicts with other keys, or pytrees of another structure): "
     "each rank must pass the same keys"),
    (dict(), dict(op=pb.BROADCAST), "x", 1, pb.MISMATCH,
     "'x': op mismatch: rank 0 sent allreduce, rank 1 sent broadcast"),
    (dict(), dict(memory="cuda"), "x", 1, pb.MISMATCH,  # unset means host memory
     "allreduce 'x': memory mismatch: rank 0 sent host, rank 1 sent cuda"),
    (dict(op=pb.ALLGATHER, shape=(2, 3), memory="cuda"),
     dict(op=pb.ALLGATHER, shape=(5, 3), memory="host"), "x", 1, pb.MISMATCH,
     "allgather 'x': memory mismatch: rank 0 sent cuda, rank 1 sent host"),
    (dict(), dict(reduce_op=pb.MAX), "x", 1, pb.MISMATCH,
     "allreduce 'x': reduce op mismatch: rank 0 sent Sum, rank 1 sent Max"),
    (dict(op=pb.BROADCAST, root_rank=0), dict(op=pb.BROADCAST, root_rank=1), "x", 1,
     pb.MISMATCH, "broadcast 'x': root rank mismatch: rank 0 sent 0, rank 1 sent 1"),
    (dict(), dict(prescale_factor=2.0), "x", 1, pb.MISMATCH,  # unset means 1.0
     "allreduce 'x': prescale factor mismatch: rank 0 sent 1.0, rank 1 sent 2.0"),
    (dict(postscale_factor=1.0), dict(postscale_factor=0.0), "x", 1, pb.MISMATCH,
     "allreduce 'x': postscale factor mismatch: rank 0 sent 1.0, rank 1 sent 0.0"),
    (dict(postscale_factor=1.0), dict(postscale_factor=0.5), "x", 1, pb.MISMATCH,
     "allreduce 'x': postscale factor mismatch: rank 0 sent 1.0, rank 1 sent 0.5"),
    (dict(op=pb.ALLGATHER, shape=(2, 3)), dict(op=pb.ALLGATHER, shape=(5, 4)), "x", 1,
     pb.MISMATCH, "allgather 'x': shape mismatch: rank 0 sent float32[2,3], "
     "rank 1 sent float32[5,4]"),
    (dict(op=pb.ALLGATHER, shape=()), dict(op=pb.ALLGATHER, shape=()), "x", 1, pb.INVALID,
     "allgather 'x': rank 0 sent a 0-d array (float32[]); allgather needs at least one "
     "dimension"),
    (dict(op=pb.BROADCAST, root_rank=7), dict(op=pb.BROADCAST, root_rank=7), "x", 1,
     pb.INVALID, "broadcast 'x': root rank 7 is not a member of process set 0 (ranks [0, 1])"),
    (dict(dtype=pb.BOOL), dict(dtype=pb.BOOL), "x", 1, pb.INVALID,
     "allreduce 'x': rank 0 sent reduce op Sum with dtype bool; only Min (logical and) and "
     "Max (logical or) are defined on bool"),
    (dict(op=pb.ALLTOALL, shape=(3, 2)), dict(op=pb.ALLTOALL, shape=(4, 2)), "x", 1,
     pb.INVALID, "alltoall 'x': rank 0 sent shape float32[3,2] whose dim 0 (3) does not "
     "divide evenly among 2 members; pass splits"),
    (dict(op=pb.ALLTOALL, shape=(4, 2), splits=[1, 3]),
     dict(op=pb.ALLTOALL, shape=(4, 2), splits=[1, 2]), "x", 1, pb.INVALID,
     "alltoall 'x': rank 1 sent splits [1, 2] (sum 3) for dim 0 of 4; splits must have 2 "
     "non-negative entries summing to dim 0"),
]


@pytest.mark.parametrize("a,b,name,bad_rank,kind,message", MISMATCHES)
def test_validation_messages(a, b, name, bad_rank, kind, message):
    size = bad_rank + 1 if bad_rank > 1 else 2
    leader = Leader(size)
    subs = [(r, req(name, **(b if r == bad_rank else a))) for r in range(size)]
    err = only_error(run(leader, *subs), list(range(size)))
    assert err.kind == kind
    assert err.message == message
    assert err.name == name
    if kind == pb.MISMATCH:
        assert (err.rank_a, err.rank_b) == (0, bad_rank)
    # the job stays usable
    out = run(leader, *[(r, req("after")) for r in range(size)])
    assert all(not out[r][0].HasField("error") for r in range(size))


def test_lowest_disagreeing_rank_reported():
    leader = Leader(4)
    out = run(leader, (3, req("x", shape=(5,))), (0, req("x")), (2, req("x", shape=(6,))),
              (1, req("x")))
    err = only_error(out, [0, 1, 2, 3])
    assert (err.rank_a, err.value_a, err.rank_b, err.value_b) == (0, "float32[4]", 2,
                                                                  "float32[6]")


# -- order and fusion ------------------------------------------------------------------
def test_global_order_same_on_all_ranks():
    leader = Leader(2, fusion_threshold=0)
    out0 = responses(leader.submit(0, [req("a"), req("b"), req("c")]))
    assert out0 == {}
    out = responses(leader.submit(1, [req("c"), req("a"), req("b")]))
    names = {r: [(x.seq, x.tensors[0].name) for x in out[r]] for r in (0, 1)}
    assert names[0] == names[1] == [(1, "c"), (2, "a"), (3, "b")]


def test_fusion_up_to_threshold():
    leader = Leader(2, fusion_threshold=40)  # float32[4] = 16 bytes
    leader.submit(0, [req("a"), req("b"), req("c"), req("big", shape=(20,)),
                      req("i", dtype=pb.INT32)])
    out = responses(leader.submit(1, [req("a"), req("b"), req("c"), req("big", shape=(20,)),
                                      req("i", dtype=pb.INT32)]))
    groups = [[t.name for t in r.tensors] for r in out[0]]
    assert groups == [["a", "b"], ["c"], ["big"], ["i"]]
    assert [r.seq for r in out[0]] == [1, 2, 3, 4]
    assert out[0] == out[1]


def test_fusion_disabled_with_threshold_zero():
    leader = Leader(1, fusion_threshold=0)
    out = responses(leader.submit(0, [req("a"), req("b")]))
    assert [[t.name for t in r.tensors] for r in out[0]] == [["a"], ["b"]]


def test_fusion_pulls_compatible_later_tensors():
    leader = Leader(1, fusion_threshold=1 << 20)
    out = responses(leader.submit(0, [req("a"), req("m", reduce_op=pb.MAX), req("b"),
                                      req("g", op=pb.ALLGATHER, shape=(2,))]))
    assert [[t.name for t in r.tensors] for r in out[0]] == [["a", "b"], ["m"], ["g"]]


def test_device_tensors_keep_their_memory_apart():
    """Responses say where their tensors live (a member that joined needs it); host and
    device tensors never fuse into one buffer; device ones get a cache slot but never an
    inline place (the cycle segment is host memory)."""
    leader = Leader(2, fusion_threshold=1 << 20, cache_capacity=8)
    calls = [req("h1"), req("d1", memory="cuda"), req("h2"), req("d2", memory="cuda"),
             req("db", op=pb.BROADCAST, memory="cuda")]
    out = run(leader, (0, *calls), (1, *calls))
    assert [[t.name for t in r.tensors] for r in out[0]] == [["h1", "h2"], ["d1", "d2"],
                                                            ["db"]]
    assert [r.memory for r in out[0]] == ["", "cuda", "cuda"]
    alone = Leader(2, fusion_threshold=0, cache_capacity=8)
    out = run(alone, (0, *calls), (1, *calls))
    tensors = {r.tensors[0].name: r.tensors[0] for r in out[0]}
    assert all(t.cache_slot for t in tensors.values())
    assert {n for n, t in tensors.items() if t.HasField("cache_inline_offset")} == {"h1",
                                                                                   "h2"}


def test_entries_allgather_and_alltoall():
    leader = Leader(2)
    out = run(leader, (0, req("g", op=pb.ALLGATHER, shape=(2, 3))),
              (1, req("g", op=pb.ALLGATHER, shape=(5, 3))),
              (0, req("t", op=pb.ALLTOALL, shape=(4,), splits=[1, 3])),
              (1, req("t", op=pb.ALLTOALL, shape=(6,))))
    g, t = out[0]
    assert list(g.tensors[0].first_dims) == [2, 5] and list(g.tensors[0].shape) == [2, 3]
    assert list(t.tensors[0].splits) == [1, 3, 3, 3]
    assert list(g.member_ranks) == [0, 1]


def test_cache_slots_and_inline_offsets():
    from ddl.core.cache_signature import INLINE_AREA_BYTES, INLINE_MAX_BYTES
    leader = Leader(2, fusion_threshold=0, cache_capacity=40)
    per = INLINE_MAX_BYTES // 4            # float32 elements filling one inline place
    fills = INLINE_AREA_BYTES // INLINE_MAX_BYTES
    both = [req("s", shape=(3,)), req("bf", dtype=pb.BFLOAT16, shape=(per + 1,)),
            req("big", shape=(per + 1,)), req("b", op=pb.BROADCAST, shape=(5,)),
            req("rs", op=pb.REDUCESCATTER, shape=(4,))]
    both += [req(f"fill{k}", shape=(per,)) for k in range(fills)]
    out = run(leader, (0, *both, req("g", op=pb.ALLGATHER, shape=(2,))),
              (1, *both, req("g", op=pb.ALLGATHER, shape=(3,))))
    tensors = {r.tensors[0].name: r.tensors[0] for r in out[0]}
    assert out[0] == out[1]
    slots = [t.cache_slot for t in tensors.values()]
    assert sorted(slots) == list(range(1, len(tensors) + 1))  # one each, from 1
    inline = {n: t.cache_inline_offset for n, t in tensors.items()
              if t.HasField("cache_inline_offset")}
    # bfloat16 is reduced in float32: twice its bytes, over the limit; a tensor over the
    # limit neither; every op goes inline, an allgather's place holding the largest
    # rank's rows (3 of float32 here, beside the place of the call before it)
    assert "bf" not in inline and "big" not in inline
    assert {"s", "b", "rs", "g"} <= set(inline)
    assert all(v % 64 == 0 for v in inline.values())
    assert all(v + per * 4 <= INLINE_AREA_BYTES for n, v in inline.items()
               if n.startswith("fill"))
    assert inline["g"] + 64 <= INLINE_AREA_BYTES
    assert len([n for n in inline if n.startswith("fill")]) == fills - 1  # the area ran full
    # the same calls again keep their slots; a changed shape on one rank gets a new one
    again = run(leader, (0, req("g", op=pb.ALLGATHER, shape=(2,)), req("s", shape=(3,))),
                (1, req("g", op=pb.ALLGATHER, shape=(4,)), req("s", shape=(3,))))
    now = {r.tensors[0].name: r.tensors[0] for r in again[0]}
    assert now["s"].cache_slot == tensors["s"].cache_slot
    assert now["s"].cache_inline_offset == tensors["s"].cache_inline_offset
    assert now["g"].cache_slot not in slots


# -- process sets ----------------------------------------------------------------------
def add_ps(name, members):
    return pb.Request(name=name, op=pb.ADD_PROCESS_SET, member_ranks=members)


def test_process_sets_add_use_remove():
    leader = Leader(4)
    out = run(leader, (0, add_ps("ps", [0, 2])), (2, add_ps("ps", [0, 2])))
    assert sorted(out) == [0, 2]
    assert out[0][0].new_process_set_id == 1 and list(out[0][0].member_ranks) == [0, 2]
    out = run(leader, (1, add_ps("ps2", [1, 3])), (3, add_ps("ps2", [1, 3])))
    assert out[1][0].new_process_set_id == 2
    again = run(leader, (0, add_ps("ps3", [0, 2])), (2, add_ps("ps3", [0, 2])))
    assert again[0][0].new_process_set_id == 1  # identical set: existing id
    # disjoint sets are independent: set 1 pending never blocks set 2
    assert run(leader, (0, req("x", process_set_id=1))) == {}
    out = run(leader, (1, req("y", process_set_id=2)), (3, req("y", process_set_id=2)))
    assert sorted(out) == [1, 3] and list(out[1][0].member_ranks) == [1, 3]
    out = run(leader, (2, req("x", process_set_id=1)))
    assert sorted(out) == [0, 2] and out[0][0].process_set_id == 1
    # remove
    rm = pb.Request(name="rm", op=pb.REMOVE_PROCESS_SET, process_set_id=1)
    out = run(leader, (0, rm), (2, rm))
    assert out[0][0].op == pb.REMOVE_PROCESS_SET and not out[0][0].HasField("error")
    assert 1 not in leader.process_sets()
    out = run(leader, (0, req("z", process_set_id=1)))
    assert out[0][0].error.kind == pb.UNKNOWN_PROCESS_SET
    assert "process set 1, which does not exist" in out[0][0].error.message


def test_process_set_errors():
    leader = Leader(4)
    out = run(leader, (0, req("x", process_set_id=9)))
    assert list(out) == [0] and out[0][0].error.kind == pb.UNKNOWN_PROCESS_SET
    run(leader, (0, add_ps("ps", [0, 1])), (1, add_ps("ps", [0, 1])))
    out = run(leader, (3, req("x", process_set_id=1)))
    assert list(out) == [3] and out[3][0].error.kind == pb.INVALID
    assert out[3][0].error.message == ("allreduce 'x': rank 3 is not a member of process "
                                       "set 1 (ranks [0, 1])")
    out = run(leader, (2, add_ps("ps", [0, 1])))   # a non-member watching: the set exists
    assert list(out) == [2] and out[2][0].new_process_set_id == 1
    out = run(leader, (2, add_ps("bad", [2, 2])))
    assert "duplicates" in out[2][0].error.message
    out = run(leader, (2, add_ps("bad", [2, 9])))
    assert "ranks must be in [0, 4)" in out[2][0].error.message
    out = run(leader, (0, pb.Request(name="rm0", op=pb.REMOVE_PROCESS_SET)))
    assert out[0][0].error.kind == pb.INVALID and "cannot be removed" in out[0][0].error.message
    out = run(leader, (0, add_ps("m", [0, 1, 2])), (1, add_ps("m", [0, 1])))
    assert out[0][0].error.kind == pb.MISMATCH and out[1][0].error.kind == pb.MISMATCH
    assert out[0][0].error.message == ("add_process_set 'm': member ranks mismatch: rank 0 "
                                       "sent [0, 1, 2], rank 1 sent [0, 1]")


def test_non_members_watch_process_sets_being_added_and_removed():
    """Horovod's scripts call add/remove_process_set on every rank: a rank outside the
    set is told its id (its end) with the members, or at once when that is known, is
    never waited for, and is told when the members cannot agree or stall."""
    clock = Clock()
    leader = Leader(4, stall_check_time=60.0, stall_shutdown_time=0.0, clock=clock)
    assert run(leader, (3, add_ps("a", [0, 1])), (0, add_ps("a", [0, 1]))) == {}
    out = run(leader, (2, add_ps("a", [0, 1])))
    assert out == {}
    out = run(leader, (2, add_ps("a", [0, 1])))   # the same rank twice: a duplicate
    assert list(out) == [2] and "submitted this name again" in out[2][0].error.message
    out = run(leader, (1, add_ps("a", [0, 1])))   # the last member: all four told
    assert sorted(out) == [0, 1, 2, 3]
    assert {out[r][0].new_process_set_id for r in out} == {1}
    assert all(list(out[r][0].member_ranks) == [0, 1] for r in out)
    out = run(leader, (3, add_ps("a", [0, 1])))   # known already: at once
    assert list(out) == [3] and out[3][0].new_process_set_id == 1
    # removal: a watcher waits for the members, then (the set gone) is answered at once
    rm = pb.Request(name="rm/1", op=pb.REMOVE_PROCESS_SET, process_set_id=1,
                    member_ranks=[0, 1])
    assert run(leader, (2, rm), (0, rm)) == {}
    out = run(leader, (1, rm))
    assert sorted(out) == [0, 1, 2] and not any(out[r][0].HasField("error") for r in out)
    assert 1 not in leader.process_sets()
    out = run(leader, (3, rm))
    assert list(out) == [3] and not out[3][0].HasField("error")
    out = run(leader, (0, rm))   # a member's call of a removed set is still an error
    assert out[0][0].error.kind == pb.UNKNOWN_PROCESS_SET
    # a non-member slower than the members, who added the set, used it and removed it
    # before its add came: told that add's id at once, then its remove at once (it once
    # waited for members that would never add it again, until one left)
    run(leader, (0, add_ps("late", [0, 1])), (1, add_ps("late", [0, 1])))
    late = leader.process_sets()
    late_id = next(i for i, m in late.items() if m == (0, 1))
    rm_late = pb.Request(name="rm/late", op=pb.REMOVE_PROCESS_SET, process_set_id=late_id,
                         member_ranks=[0, 1])
    run(leader, (0, rm_late), (1, rm_late))
    assert late_id not in leader.process_sets()
    out = run(leader, (2, add_ps("late", [0, 1])))
    assert list(out) == [2] and out[2][0].new_process_set_id == late_id, out
    out = run(leader, (2, rm_late))
    assert list(out) == [2] and not out[2][0].HasField("error")
    assert not leader.pending_names()
    # a stall names the watchers and warns them too; a member leaving fails them
    assert run(leader, (0, add_ps("b", [0, 2])), (3, add_ps("b", [0, 2]))) == {}
    clock.t += 60.0
    warned = leader.inspect_stalls()
    assert sorted(r for r, _ in warned) == [0, 2, 3]
    assert warned[0][1].warning.message == (
        "stall: add_process_set 'b' for ranks [0, 2] has waited 60.0 s: submitted by ranks "
        "[0], watched by ranks [3], missing ranks [2]")
    out = responses(leader.goodbye(2))
    assert sorted(out) == [0, 3] and out[3][0].error.kind == pb.PEER_LOST
    assert "rank 2 (host ?, pid 0) has shut down" in out[3][0].error.message
    out = run(leader, (1, add_ps("c", [0, 2])))   # watching a set of a departed member
    assert list(out) == [1] and out[1][0].error.kind == pb.PEER_LOST
    # a watcher that leaves is forgotten: nothing waits on its account
    assert run(leader, (3, add_ps("d", [0, 1]))) == {}
    leader.goodbye(3)
    assert not leader.pending_names()


# -- join ------------------------------------------------------------------------------
def join(name="join"):
    return pb.Request(name=name, op=pb.JOIN)


def test_join_allreduce_allgather_and_last_joined_rank():
    leader = Leader(3)
    assert run(leader, (0, req("x")), (1, req("x"))) == {}
    out = run(leader, (2, join()))  # joining completes the pending name
    assert sorted(out) == [0, 1, 2]
    assert list(out[2][0].joined_ranks) == [2] and out[2][0].tensors[0].name == "x"
    out = run(leader, (0, req("g", op=pb.ALLGATHER, shape=(3, 2))),
              (1, req("g", op=pb.ALLGATHER, shape=(1, 2))))
    assert list(out[2][0].tensors[0].first_dims) == [3, 1, 0]
    out = run(leader, (0, req("b", op=pb.BROADCAST)), (1, req("b", op=pb.BROADCAST)))
    assert sorted(out) == [0, 1, 2]  # a joined non-root takes part, receiving nothing
    assert list(out[2][0].joined_ranks) == [2] and out[2][0].root_rank == 0
    out = run(leader, (0, join()))
    assert out == {}
    out = run(leader, (1, join()))
    assert sorted(out) == [0, 1, 2]
    assert out[0][0].op == pb.JOIN and out[0][0].last_joined_rank == 1
    out = run(leader, (0, req("y")), (1, req("y")))
    assert out == {}  # joined state was reset: rank 2 is needed again
    out = run(leader, (2, req("y")))
    assert list(out[0][0].joined_ranks) == []


def join_ps(set_id, name="join"):
    return pb.Request(name=name, op=pb.JOIN, process_set_id=set_id)


def test_join_every_op():
    """With rank 2 of 3 joined: reducescatter and alltoall complete with it (neutral
    values; no rows either way), a broadcast from it fails on every rank waiting, and so
    does an alltoall that sends it rows."""
    leader = Leader(3)
    assert run(leader, (2, join())) == {}
    rs = req("rs", op=pb.REDUCESCATTER, shape=(5, 2), reduce_op=pb.AVERAGE)
    out = run(leader, (0, rs), (1, rs))
    assert sorted(out) == [0, 1, 2] and list(out[2][0].joined_ranks) == [2]
    assert out[2][0].reduce_op == pb.AVERAGE and list(out[2][0].member_ranks) == [0, 1, 2]
    out = run(leader, (0, req("a", op=pb.ALLTOALL, shape=(3, 2), splits=[1, 2, 0])),
              (1, req("a", op=pb.ALLTOALL, shape=(0, 2), splits=[0, 0, 0])))
    assert sorted(out) == [0, 1, 2]
    assert list(out[2][0].tensors[0].splits) == [1, 2, 0, 0, 0, 0, 0, 0, 0]
    out = run(leader, (0, req("b", op=pb.BROADCAST, root_rank=2)),
              (1, req("b", op=pb.BROADCAST, root_rank=2)))
    err = only_error(out, [0, 1])
    assert err.kind == pb.INVALID and err.rank_a == 2 and err.op == "broadcast"
    assert err.message == (
        "broadcast 'b': root rank 2 has joined (called ddl.join) and sends nothing; ranks "
        "[0, 1] of process set 0 were waiting for it. To fix this, broadcast from a rank "
        "that has not joined, or before the root calls join")
    out = run(leader, (0, req("e", op=pb.ALLTOALL, shape=(3, 2))),
              (1, req("e", op=pb.ALLTOALL, shape=(3, 2))))
    err = only_error(out, [0, 1])
    assert err.kind == pb.INVALID and (err.rank_a, err.rank_b) == (0, 2)
    assert err.message == (
        "alltoall 'e': rank 0 sent 1 rows (splits [1, 1, 1]) to rank 2, which has joined "
        "(called ddl.join) and receives nothing; joined ranks: [2]. To fix this, pass "
        "splits with 0 rows for each joined rank")
    out = run(leader, (0, join()), (1, join()))
    assert out[0][-1].op == pb.JOIN and out[0][-1].last_joined_rank == 1


def test_a_broadcast_pending_when_its_root_joins_fails():
    leader = Leader(3)
    assert run(leader, (0, req("b", op=pb.BROADCAST, root_rank=1)),
               (2, req("b", op=pb.BROADCAST, root_rank=1))) == {}
    err = only_error(run(leader, (1, join())), [0, 2])
    assert err.message.startswith("broadcast 'b': root rank 1 has joined")


def test_join_of_a_process_set():
    """join(process_set) counts in that set only; a global join counts in every set; the
    set's join completes for its joiners once each member joined it or globally."""
    leader = Leader(4)
    run(leader, (0, add_ps("s", [0, 1, 2])), (1, add_ps("s", [0, 1, 2])),
        (2, add_ps("s", [0, 1, 2])))
    assert run(leader, (2, join_ps(1))) == {}
    out = run(leader, (0, req("x", process_set_id=1)), (1, req("x", process_set_id=1)))
    assert sorted(out) == [0, 1, 2] and list(out[0][0].joined_ranks) == [2]
    # rank 2 joined set 1 only: the global set still needs it
    assert run(leader, (0, req("g")), (1, req("g")), (3, req("g"))) == {}
    assert run(leader, (1, join())) == {}  # a global join counts in set 1 too
    out = run(leader, (0, req("y", process_set_id=1)))
    assert sorted(out) == [0, 1, 2] and list(out[0][0].joined_ranks) == [1, 2]
    out = run(leader, (0, join_ps(1)))  # every member of set 1 has joined it or globally
    assert sorted(out) == [0, 2]
    assert out[0][0].op == pb.JOIN and out[0][0].process_set_id == 1
    assert out[0][0].last_joined_rank == 0
    out = run(leader, (2, req("g")))  # rank 1 had submitted it before it joined
    assert sorted(out) == [0, 1, 2, 3] and list(out[0][0].joined_ranks) == []
    out = run(leader, (0, req("h")), (2, req("h")), (3, req("h")))
    assert list(out[0][0].joined_ranks) == [1]
    out = run(leader, (2, join_ps(1)))  # a new round of set 1
    assert out == {}
    assert only_error(run(leader, (2, join_ps(1))), [2]).message == (
        "join 'join': rank 2 has already joined process set 1")
    assert only_error(run(leader, (3, join_ps(1))), [3]).message == (
        "join 'join': rank 3 is not a member of process set 1 (ranks [0, 1, 2])")
    assert only_error(run(leader, (3, join_ps(7))), [3]).message == (
        "join 'join': rank 3 named process set 7, which does not exist; existing process "
        "sets: [0, 1]")


# -- stalls and departures -------------------------------------------------------------
def test_stall_warning_then_abort():
    clock = Clock()
    leader = Leader(4, stall_check_time=60.0, stall_shutdown_time=120.0, clock=clock)
    leader.submit(0, [req("x")])
    leader.submit(2, [req("x")])
    clock.t += 1.0
    leader.submit(1, [req("y"), req("z")])   # rank 1 made other calls (say whose)
    assert leader.inspect_stalls() == []
    clock.t += 59.0
    out = leader.inspect_stalls()
    assert sorted(r for r, _ in out) == [0, 1, 2, 3]
    assert out[0][1].warning.message == ("stall: allreduce 'x' in process set 0 has waited "
                                         "60.0 s: submitted by ranks [0, 2], missing ranks "
                                         "[1, 3]; rank 1 waits on allreduce 'y' in process "
                                         "set 0 (and 1 more)")
    assert leader.inspect_stalls() == []  # one warning only
    clock.t += 60.0
    out = leader.inspect_stalls()
    assert sorted(r for r, _ in out) == [0, 1, 2, 3]
    assert out[0][1].abort.kind == pb.STALL
    assert out[0][1].abort.message.startswith("allreduce 'x' in process set 0")
    assert leader.fatal is not None


def test_goodbye_fails_names_needing_the_rank():
    leader = Leader(3)
    leader.set_peer(1, "h", 9)
    run(leader, (0, req("x")))
    delivered = leader.goodbye(1)
    notices = [(r, m.warning.message) for r, m in delivered if m.WhichOneof("kind") == "warning"]
    assert notices == [(r, "rank 1 (host h, pid 9) has shut down: it called ddl.shutdown()")
                       for r in (0, 2)]  # ranks waiting in a cached call learn who left
    out = responses(delivered)
    assert list(out) == [0]
    assert out[0][0].error.kind == pb.PEER_LOST
    assert out[0][0].error.message == "allreduce 'x': rank 1 (host h, pid 9) has shut down"
    out = run(leader, (2, req("later")))
    assert out[2][0].error.message == "allreduce 'later': rank 1 (host h, pid 9) has shut down"


def test_goodbye_fails_the_joins_waiting_for_the_rank():
    """A rank that leaves without joining fails the joins that wait for it (global and
    of its sets), on the ranks in them, with PEER_LOST naming it."""
    leader = Leader(4)
    leader.set_peer(3, "h", 9)
    run(leader, (0, add_ps("s", [0, 3])), (3, add_ps("s", [0, 3])))
    run(leader, (1, add_ps("t", [1, 2])), (2, add_ps("t", [1, 2])))
    assert run(leader, (0, join_ps(1)), (1, join())) == {}
    out = run(leader, (2, join_ps(2)))  # rank 1 joined globally: set 2's join completes
    assert list(out) == [2] and out[2][0].last_joined_rank == 2
    out = responses(leader.goodbye(3))
    assert sorted(out) == [0, 1]
    assert [(r.op, r.process_set_id) for r in out[0] + out[1]] == [(pb.JOIN, 1), (pb.JOIN, 0)]
    assert out[0][0].error.kind == pb.PEER_LOST and out[0][0].error.origin_rank == 3
    assert out[1][0].error.message == "join 'join': rank 3 (host h, pid 9) has shut down"
    out = run(leader, (2, join()))  # a join after it left fails at once
    assert out[2][0].error.message == "join 'join': rank 3 (host h, pid 9) has shut down"


def test_lost_rank_aborts_the_others():
    leader = Leader(3)
    leader.set_peer(2, "hostB", 1234)
    out = leader.lost(2, "its control stream closed without a goodbye")
    assert sorted(r for r, _ in out) == [0, 1]
    abort = out[0][1].abort
    assert abort.kind == pb.PEER_LOST and abort.origin_rank == 2 and abort.origin_pid == 1234
    assert abort.message == ("rank 2 (host hostB, pid 1234) was lost: its control stream "
                             "closed without a goodbye")


def test_duplicate_name_in_flight_is_invalid():
    leader = Leader(2)
    out = run(leader, (0, req("x")), (0, req("x")))
    assert list(out) == [0] and "submitted this name again" in out[0][0].error.message


def part(name: str, call: int, size: int, **kw) -> pb.Request:
    return req(name, call_id=call, group_size=size, **kw)


def errors(out, rank) -> Dict[str, str]:
    return {r.tensors[0].name: r.error.message for r in out.get(rank, [])}


def test_a_call_that_failed_at_one_part_never_pairs_its_others():
    """Request.call_id: a group of 3 on rank 0 and of 2 on rank 1 fails at its first
    name, and rank 0's third part fails with it (it would wait for a call rank 1 never
    makes, or pair with rank 1's next call of the name)."""
    leader = Leader(2)
    assert run(leader, (0, *[part(f"g/{i}", 1, 3) for i in range(3)])) == {}
    out = run(leader, (1, *[part(f"g/{i}", 4, 2) for i in range(2)]))
    mismatch = ("allreduce 'g/0': group size mismatch: rank 0 sent a group of 3 arrays, "
                "rank 1 sent a group of 2 arrays")
    def not_run(name, rank):
        return (f"allreduce '{name}': not run: rank {rank}'s call of which it is a part "
                f"failed at 'g/0': {mismatch}")
    # rank 1's g/1 comes after its call failed; rank 0's g/1 and g/2 are withdrawn
    assert errors(out, 1) == {"g/0": mismatch, "g/1": not_run("g/1", 1)}
    assert errors(out, 0) == {"g/0": mismatch, "g/1": not_run("g/1", 0),
                              "g/2": not_run("g/2", 0)}
    assert leader.pending_names() == []
    out = run(leader, (1, *[part(f"g/{i}", 5, 3) for i in range(3)]),   # retried: runs
              (0, *[part(f"g/{i}", 2, 3) for i in range(3)]))
    assert sum(len(r.tensors) for r in out[0]) == 3
    assert not any(r.HasField("error") for r in out[0] + out[1])


def test_parts_of_a_failed_call_fail_on_arrival_and_withdraw_the_names_they_held():
    leader = Leader(3)
    # rank 2's g/1 waits with rank 0's; rank 2's g/2 waits alone
    assert run(leader, (0, part("g/1", 1, 3)), (2, part("g/1", 9, 3), part("g/2", 9, 3))) == {}
    out = run(leader, (0, part("g/0", 1, 3)), (2, part("g/0", 9, 3)),
              (1, part("g/0", 3, 3, dtype=pb.FLOAT64)))
    assert "dtype mismatch" in errors(out, 1)["g/0"]
    assert errors(out, 2)["g/1"].startswith(
        "allreduce 'g/1': not run: rank 0's call of which it is a part failed at 'g/0': "
        "allreduce 'g/0': dtype mismatch")  # withdrawn, and so is rank 2's g/2 in turn:
    assert errors(out, 2)["g/2"].startswith(
        "allreduce 'g/2': not run: rank 2's call of which it is a part failed at 'g/0'")
    assert leader.pending_names() == []
    out = run(leader, (1, part("g/1", 3, 3)), (0, part("g/2", 1, 3)))  # late: at once
    assert errors(out, 1)["g/1"].startswith("allreduce 'g/1': not run: rank 1's call")
    assert errors(out, 0)["g/2"].startswith("allreduce 'g/2': not run: rank 0's call")
    assert leader.pending_names() == []


def test_a_call_refused_at_one_part_on_its_own_rank_fails_as_a_whole():
    """An error that only the sending rank gets (a name already in flight, a process set
    that does not exist) fails its call too."""
    leader = Leader(2)
    assert run(leader, (0, part("g/0", 1, 2))) == {}
    out = run(leader, (0, part("g/1", 2, 2), part("g/0", 2, 2)))  # call 2 repeats g/0
    assert "submitted this name again" in errors(out, 0)["g/0"]
    assert errors(out, 0)["g/1"].startswith("allreduce 'g/1': not run: rank 0's call")
    assert [p.name for p in leader.pending_names()] == ["g/0"]   # call 1's, untouched
    out = run(leader, (0, part("h/0", 3, 2), part("h/1", 3, 2, process_set_id=5)))
    assert "process set 5, which does not exist" in errors(out, 0)["h/1"]
    assert errors(out, 0)["h/0"].startswith("allreduce 'h/0': not run: rank 0's call")


def test_a_failed_call_s_late_part_takes_the_local_error_it_owes():
    """A part refused because its call already failed still answers the local error the
    rank owes for that name (else the rank's next call of the name would get it)."""
    leader = Leader(3)
    bad = [part(f"g/{i}", 3, 2, local_error="passed None") for i in range(2)]
    assert sorted(run(leader, (1, *bad))) == [1]   # g/1 does not run: g/0 failed
    assert len(leader.failed_names()) == 1         # ranks 0 and 2 owe g/0's error
    # g/1 of ranks 0 and 2 waits for rank 1's (their g/0 is late: in cache cycles)
    assert run(leader, (0, part("g/1", 1, 2)), (2, part("g/1", 9, 2))) == {}
    out = run(leader, (0, part("g/0", 1, 2)))   # rank 0's call fails, and g/1 with it:
    failed = "allreduce 'g/0': rank 1 passed None"
    assert errors(out, 0) == {"g/0": failed, "g/1": "allreduce 'g/1': not run: rank 0's "
                              f"call of which it is a part failed at 'g/0': {failed}"}
    assert list(errors(out, 2)) == ["g/1"]      # so rank 2's call failed at g/1
    out = run(leader, (2, part("g/0", 9, 2)))   # refused, with the error it owes
    assert errors(out, 2) == {"g/0": failed}
    assert leader.failed_names() == [] and leader.pending_names() == []
    out = run(leader, *[(r, part("g/0", 20 + r, 2)) for r in range(3)])
    assert sorted(out) == [0, 1, 2] and not out[0][0].HasField("error")


# -- one rank's local error (Request.local_error) -----------------------------------------
ROOT7 = "passed root_rank=7, but process set 0 has ranks 0..3"
ROOT7_MESSAGE = f"broadcast 'w': rank 1 {ROOT7}"


def test_local_error_fails_submitted_members_at_once_and_later_ones_on_arrival():
    leader = Leader(4)
    good = req("w", op=pb.BROADCAST)
    assert run(leader, (0, good), (3, good)) == {}
    out = run(leader, (1, req("w", op=pb.BROADCAST, dtype=0, shape=(), local_error=ROOT7)))
    err = only_error(out, [0, 1, 3])
    assert (err.kind, err.message, err.rank_a, err.value_a) == (
        pb.INVALID, ROOT7_MESSAGE, 1, ROOT7)
    assert leader.pending_names() == [] and len(leader.failed_names()) == 1
    out = run(leader, (2, good))  # rank 2 submits late: the same error, at once
    assert list(out) == [2] and out[2][0].error.message == ROOT7_MESSAGE
    assert leader.failed_names() == []
    out = run(leader, *[(r, good) for r in range(4)])  # the name is free again
    assert sorted(out) == [0, 1, 2, 3] and not out[0][0].HasField("error")


def test_local_error_rounds_of_one_name_are_answered_in_order():
    """The bad rank's next call of the name (good here) is a new round: a member that has
    not submitted the failed round yet gets that round's error first."""
    leader = Leader(2)
    bad = req("x", local_error="passed op='sum'; op must be one of ddl.Sum")
    out = run(leader, (1, bad))
    assert list(out) == [1] and out[1][0].error.message.startswith("allreduce 'x': rank 1 ")
    assert run(leader, (1, req("x"))) == {}  # rank 1 again: waits for rank 0's second call
    out = run(leader, (0, req("x")))
    assert list(out) == [0] and out[0][0].error.message == out_message(bad)
    out = run(leader, (0, req("x")))
    assert sorted(out) == [0, 1] and not out[0][0].HasField("error")
    assert leader.pending_names() == [] and leader.failed_names() == []


def out_message(bad: pb.Request) -> str:
    return f"allreduce '{bad.name}': rank 1 {bad.local_error}"


def test_local_error_of_two_ranks_and_departures_leave_no_state():
    leader = Leader(3)
    leader.set_peer(2, "h", 9)
    out = run(leader, (0, req("y", local_error="passed None")))
    assert list(out) == [0]
    out = run(leader, (1, req("y", local_error="passed None too")))  # owes round 1
    assert out[1][0].error.message == "allreduce 'y': rank 0 passed None"
    leader.goodbye(2)  # the last rank owing it left
    assert leader.failed_names() == [] and leader.pending_names() == []


def test_local_error_on_a_process_set_and_its_removal():
    leader = Leader(3)
    run(leader, (0, add_ps("ps", [0, 2])), (2, add_ps("ps", [0, 2])))
    out = run(leader, (2, req("z", process_set_id=1, local_error="passed None")))
    assert list(out) == [2] and out[2][0].process_set_id == 1
    assert list(out[2][0].member_ranks) == [0, 2]
    rm = pb.Request(name="rm", op=pb.REMOVE_PROCESS_SET, process_set_id=1)
    run(leader, (0, rm), (2, rm))
    assert leader.failed_names() == []  # rank 0 will never owe a removed set's name
    long = "x" * 5000
    out = run(leader, (1, req("q", local_error=long)))
    assert out[1][0].error.message.endswith("... (5000 chars)")


def test_local_error_of_a_join_is_the_rank_s_own():
    leader = Leader(2)
    out = run(leader, (1, pb.Request(name="join", op=pb.JOIN, local_error="passed timeout=nan")))
    assert list(out) == [1]
    assert out[1][0].error.message == "join 'join': rank 1 passed timeout=nan"
    out = run(leader, (0, pb.Request(name="join", op=pb.JOIN)),
              (1, pb.Request(name="join", op=pb.JOIN)))
    assert sorted(out) == [0, 1] and out[0][0].last_joined_rank == 1  # rank 1 never joined


def _add_set(*ranks):
    return pb.Request(name="add_process_set/" + ",".join(map(str, ranks)),
                      op=pb.ADD_PROCESS_SET, member_ranks=list(ranks))


def _bad_add():
    """An add_process_set whose ranks were invalid on its rank (no set name)."""
    return pb.Request(name="add_process_set/?", op=pb.ADD_PROCESS_SET,
                      local_error="passed invalid ranks [0.5, 1]: ranks must be ints")


def test_an_add_process_set_with_invalid_ranks_fails_the_sets_waiting_for_that_rank():
    """Rank 1's add_process_set has no set name (its ranks were invalid): the add that
    waits for it fails now, rank 2's later add that lists rank 1 fails once on arrival,
    and after rank 1's valid add the set is made; an add not listing rank 1 is untouched."""
    add, bad = _add_set, _bad_add()
    leader = Leader(4)
    assert run(leader, (0, add(0, 1)), (3, add(0, 3))) == {}
    out = run(leader, (1, bad))
    assert sorted(out) == [0, 1] and out[0][0].error.message == out[1][0].error.message
    err = out[0][0].error
    assert err.kind == pb.INVALID and err.rank_a == 1 and err.message == (
        "add_process_set: rank 1 passed invalid ranks [0.5, 1]: ranks must be ints")
    out = run(leader, (2, add(1, 2)))  # late: told once
    assert list(out) == [2] and out[2][0].error.message == err.message
    out = run(leader, (2, add(1, 2)), (1, add(1, 2)))  # both retry: the set is made
    assert sorted(out) == [1, 2] and not out[1][0].HasField("error")
    out = run(leader, (0, add(0, 3)))  # rank 3's add never waited on rank 1
    assert sorted(out) == [0, 3] and not out[0][0].HasField("error")


@pytest.mark.parametrize("order", ["bad, bad, valid, valid", "bad, valid, bad, valid"])
def test_every_rank_passing_the_same_invalid_ranks_then_valid_ones_makes_the_set(order):
    """Each rank's failed add_process_set is the other's of the same round: its next,
    valid one is not failed with the other's stale error, in either order of arrival
    (it was, and the job stalled or died)."""
    leader = Leader(3)
    if order == "bad, bad, valid, valid":
        assert [sorted(run(leader, (r, _bad_add()))) for r in (0, 1)] == [[0], [1]]
        assert run(leader, (0, _add_set(0, 1))) == {}
    else:
        assert sorted(run(leader, (0, _bad_add()))) == [0]
        assert run(leader, (0, _add_set(0, 1))) == {}   # waits for rank 1's valid one
        assert sorted(run(leader, (1, _bad_add()))) == [1]   # its own error only
    out = run(leader, (1, _add_set(0, 1)))
    assert sorted(out) == [0, 1] and not any(out[r][0].HasField("error") for r in (0, 1))


@pytest.mark.parametrize("sets, rounds, retry", [
    ({0: (0, 1), 1: (0, 1)}, 3, False),                        # every rank, 3 bad rounds
    ({0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}, 2, False),  # two sets at once
    ({0: (0, 1), 1: (0, 1)}, 0, True)])                        # rank 1 alone, rank 0 retries
def test_failed_add_process_set_rounds_in_any_order_of_arrival(sets, rounds, retry):
    """Every member fails ``rounds`` add_process_set calls (the same bad ranks), then
    makes its set, the messages arriving in a random order: every member's last call
    makes the set. With ``retry``, rank 1 alone fails one, and rank 0 (whose valid call
    that round fails with rank 1's error) calls again."""
    import random
    for seed in range(200):
        rnd, leader = random.Random(seed), Leader(max(sets) + 1)
        calls = {r: [_bad_add()] * (1 if retry and r == 1 else rounds) + [_add_set(*sets[r])]
                 for r in sets}
        last = {}
        while any(calls.values()):
            r = rnd.choice([r for r in calls if calls[r]])
            for to, msgs in run(leader, (r, calls[r].pop(0))).items():
                for m in msgs:
                    last[to] = m.HasField("error")
                    if retry and to == 0 and m.HasField("error"):
                        calls[0].append(_add_set(*sets[0]))
        assert last == {r: False for r in sets}, (seed, last)


def test_a_failed_round_long_past_does_not_pair_with_a_new_failure():
    """Ranks 0 and 1 fail an add_process_set, then make their set; later rank 2 fails its
    first one while rank 0's add of {0, 2} waits: rank 0's fails with rank 2's error
    (rank 2's failure is no partner of that old round), and both retries make the set."""
    leader = Leader(3)
    run(leader, (0, _bad_add()), (1, _bad_add()))
    out = run(leader, (0, _add_set(0, 1)), (1, _add_set(0, 1)))
    assert sorted(out) == [0, 1] and not out[0][0].HasField("error")
    assert run(leader, (0, _add_set(0, 2))) == {}
    out = run(leader, (2, _bad_add()))
    assert sorted(out) == [0, 2] and out[0][0].error.rank_a == 2, out
    out = run(leader, (0, _add_set(0, 2)), (2, _add_set(0, 2)))
    assert sorted(out) == [0, 2] and not out[2][0].HasField("error")


def test_responses_say_how_long_each_member_waited_for_the_last():
    """The Timeline's per-rank ready marks: ``ready_us`` per member, in member order."""
    clock = Clock()
    leader = Leader(3, clock=clock)
    leader.submit(1, [req("x")])
    clock.t += 0.25
    leader.submit(0, [req("x")])
    clock.t += 0.5
    out = run(leader, (2, req("x")))
    t = out[0][0].tensors[0]
    assert list(out[0][0].member_ranks) == [0, 1, 2]
    assert list(t.ready_us) == [500_000, 750_000, 0]


def test_an_inline_place_holds_every_ranks_input():
    """An allgather's or alltoall's input differs per rank: its inline place is sized for
    the largest (the next place starts after it), a reducescatter's for its packed form."""
    leader = Leader(2, fusion_threshold=0, cache_capacity=8)
    out = run(leader, (0, req("g", op=pb.ALLGATHER, shape=(2,)), req("t", op=pb.ALLTOALL,
                                                                     shape=(2,))),
              (1, req("g", op=pb.ALLGATHER, shape=(100,)), req("t", op=pb.ALLTOALL,
                                                               shape=(40,), splits=[1, 39])),
              (0, req("r", op=pb.REDUCESCATTER, shape=(30,), dtype=pb.INT32,
                      reduce_op=pb.AVERAGE), req("after", shape=(1,))),
              (1, req("r", op=pb.REDUCESCATTER, shape=(30,), dtype=pb.INT32,
                      reduce_op=pb.AVERAGE), req("after", shape=(1,))))
    at = {r.tensors[0].name: r.tensors[0].cache_inline_offset for r in out[0]}
    assert at["t"] - at["g"] == 448      # 100 float32 of rank 1, in 64-byte steps
    assert at["r"] - at["t"] == 192      # 40 float32 of rank 1
    assert at["after"] - at["r"] == 256  # 30 int32 averaged as int64
