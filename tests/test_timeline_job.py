"""The Timeline in a real job: DDL_TIMELINE, the {rank} rule, start/stop at run time."""

import json
import os

import numpy as np
import pytest

import ddl

from test_shm_collectives import siblings_can_cma


def _work():
    x = np.ones(1000, np.float32)
    for step in range(5):
        ddl.allreduce(x, name="grad/w", op=ddl.Sum)
        ddl.allreduce([x, x[:10]], name="fused", op=ddl.Sum)  # two tensors, one response
    ddl.broadcast(x, root_rank=0, name="bcast")
    ddl.allgather(x, name="gather")


def _run_with_api(path):
    _work()
    ddl.start_timeline(path, mark_cycles=True)
    _work()
    ddl.stop_timeline()
    return ddl.rank()


def _phases(path):
    with open(path) as f:
        events = json.load(f)  # valid JSON
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    phases = {}
    for e in events:
        if e.get("ph") == "B":
            phases.setdefault(rows[e["tid"]], set()).add(e["name"])
    return events, phases


@pytest.mark.timeout(120)
def test_timeline_from_the_environment_one_file_per_rank(tmp_path):
    pattern = str(tmp_path / "tl-{rank}.json")
    ddl.run(_work, np=2, env={"DDL_TIMELINE": pattern})
    for rank in range(2):
        events, phases = _phases(str(tmp_path / f"tl-{rank}.json"))
        assert {"NEGOTIATE", "QUEUE", "ALLREDUCE"} <= phases["grad/w"], phases
        fused_rows = [p for name, p in phases.items() if name.startswith("fused")]
        assert len(fused_rows) == 2 and all("MEMCPY_IN_FUSION_BUFFER" in p for p in fused_rows)
        assert "BROADCAST" in phases["bcast"] and "ALLGATHER" in phases["gather"]
        collective = [e for e in events if e.get("name") == "ALLREDUCE" and e["ph"] == "B"]
        assert all(e["args"]["transport"] in ("shm", "tcp") for e in collective)
        assert all(e["pid"] == rank for e in events if "pid" in e)
        # each rank's ready mark on the rows the leader negotiated (from its wait times)
        rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        for name in ("grad/w", "bcast", "gather"):
            ticks = sorted(e["args"]["rank"] for e in events
                           if e.get("ph") == "i" and rows.get(e["tid"]) == name)
            assert ticks == [0, 1], (name, ticks)


@pytest.mark.timeout(120)
def test_timeline_started_and_stopped_at_run_time_rank0_only(tmp_path):
    path = str(tmp_path / "tl.json")
    assert ddl.run(_run_with_api, args=(path,), np=2) == [0, 1]
    events, phases = _phases(path)
    assert phases["grad/w"] >= {"NEGOTIATE", "QUEUE", "ALLREDUCE"}
    assert any(e.get("name") == "CYCLE" for e in events)  # mark_cycles
    assert sorted(os.listdir(tmp_path)) == ["tl.json"]  # rank 1 wrote nothing


def _forced_work():
    x = np.arange(80_000, dtype=np.float32)  # 320 KB: above the inline limit and 256 KiB
    small = np.ones(10, np.float32)
    mid = np.arange(30_000, dtype=np.float32)  # 120 KB: no inline place, fits the lone one
    bad = []
    for step in range(3):
        if not np.array_equal(ddl.allreduce(mid, name="mid", op=ddl.Sum), 2 * mid):
            bad.append(f"mid step {step}")
        if not np.array_equal(ddl.allreduce(x, name="big", op=ddl.Sum), 2 * x):
            bad.append(f"big step {step}")
        if not np.array_equal(ddl.allreduce(small, name="small", op=ddl.Sum), 2 * small):
            bad.append(f"small step {step}")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forced", ["one_round", "reduce_scatter", "cross_memory"])
def test_forced_shm_allreduce_algorithm_runs_and_shows_in_the_timeline(tmp_path, forced):
    """(cross_memory runs where the kernel lets the ranks read each other's memory, else
    the segment's reduce_scatter.)"""
    path = str(tmp_path / "tl.json")
    out = ddl.run(_forced_work, np=2, env={"DDL_TIMELINE": path,
                                           "DDL_SHM_ALLREDUCE_ALGORITHM": forced})
    assert out == [[], []]
    events, _ = _phases(path)
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    algos = {}
    for e in events:
        if e.get("name") == "ALLREDUCE" and e["ph"] == "B":
            algos.setdefault(rows[e["tid"]], set()).add(e["args"]["algorithm"])
    ran = forced if forced != "cross_memory" or siblings_can_cma() else "reduce_scatter"
    # cached calls the group runs in one round ride with the votes (the lone place)
    lone = {"cycle_lone"} if ran == "one_round" else set()
    assert algos["big"] == {ran} | lone, algos    # first call and cached ones alike
    assert algos["mid"] == {ran} | lone, algos
    # the small one: forced on its first call (through the leader), inline afterwards
    assert algos["small"] == {ran, "cycle_inline"}, algos
