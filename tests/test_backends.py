"""The data-plane seam: which backend carries a call (ddl/dataplane/backends), and the one fusion
rule that the leader and the cache cycles share (ddl/core/fusion.py). No process worlds: the
selection and the rule depend only on the call, the hosts and the configuration."""

from __future__ import annotations

import types

import pytest

from ddl.core import config as _config
from ddl.dataplane.backends import ORDER, Backends, DataPlane
from ddl.dataplane.backends.shm import ShmGroups
from ddl.dataplane.transports import shm
from ddl.dataplane.transports.base import Group
from ddl.runtime.cycles import CycleRunner
from ddl.server.fusion import ReadyItem, flush
from ddl.v1 import coordinator_pb2 as pb

needs_shm = pytest.mark.skipif(not shm.available(), reason="no shared memory here")


def _backends(hosts, rank=0, **env):
    cfg = _config.load({k: str(v) for k, v in env.items()})
    groups = ShmGroups(cfg.transport, "job", b"s" * 32, rank, hosts, lambda: None)
    return Backends(DataPlane(rank, cfg, transport=None, shm_groups=groups, hosts=hosts))


def _pick(backends, op, ranks, nbytes=1 << 20, rank=0):
    return backends.pick(op, Group.of(ranks, rank), nbytes).name


def test_tcp_is_last_and_carries_everything():
    assert ORDER[-1].name == "tcp"
    b = _backends({0: "a", 1: "b"})
    for op in (pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL, pb.REDUCESCATTER):
        assert _pick(b, op, [0, 1]) == "tcp"


@needs_shm
def test_one_host_is_shared_memory_unless_tcp_is_forced():
    hosts = {r: "a" for r in range(3)}
    assert _pick(_backends(hosts), pb.BROADCAST, [0, 2]) == "shm"
    assert _pick(_backends(hosts), pb.ALLREDUCE, [0]) == "tcp"  # a group of one
    assert _pick(_backends(hosts, DDL_TRANSPORT="tcp"), pb.ALLREDUCE, [0, 1]) == "tcp"


@needs_shm
def test_hierarchical_where_enabled_and_balanced():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    auto = _backends(hosts)
    assert _pick(auto, pb.ALLREDUCE, range(4), nbytes=1 << 20) == "shm+tcp"
    assert _pick(auto, pb.ALLREDUCE, range(4), nbytes=64) == "tcp"  # small: flat
    assert _pick(auto, pb.ALLGATHER, range(4)) == "tcp"  # allgather auto: off
    assert _pick(auto, pb.BROADCAST, range(4)) == "tcp"
    assert _pick(auto, pb.ALLREDUCE, [0, 2]) == "tcp"  # one member per host
    assert _pick(auto, pb.ALLREDUCE, [0, 1, 2]) == "tcp"  # unbalanced
    assert _pick(auto, pb.ALLREDUCE, [0, 1]) == "shm"
    on = _backends(hosts, DDL_HIERARCHICAL_ALLREDUCE="on", DDL_HIERARCHICAL_ALLGATHER="on")
    assert _pick(on, pb.ALLREDUCE, range(4), nbytes=64) == "shm+tcp"
    assert _pick(on, pb.ALLGATHER, range(4)) == "shm+tcp"
    off = _backends(hosts, DDL_HIERARCHICAL_ALLREDUCE="off")
    assert _pick(off, pb.ALLREDUCE, range(4)) == "tcp"
    assert _pick(_backends(hosts, DDL_TRANSPORT="tcp"), pb.ALLREDUCE, range(4)) == "tcp"


def test_device_arrays_take_their_group_s_plan():
    """The device backends follow each group's agreed plan (device_plan): IPC for one
    island, NCCL for ranks each on a GPU of its own (peer GPUs of one host among several
    hosts included), IPC islands joined by NCCL for allreduce and broadcast where two
    ranks share a GPU in a job of several hosts, the host for the rest; a group with no
    plan yet has no device backend."""
    from ddl.dataplane.backends import DEVICE_ORDER
    from ddl.dataplane.backends.device_plan import DeviceInfo, plan
    assert [c.name for c in DEVICE_ORDER] == ["cuda_ipc", "nccl", "cuda_ipc+nccl", "staged"]
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    b = _backends(hosts)
    one_gpu, own_gpus, hier = (0, 1), (0, 2), (0, 1, 2, 3)
    infos = {0: DeviceInfo("a", "G0"), 1: DeviceInfo("a", "G0"), 2: DeviceInfo("b", "G1"),
             3: DeviceInfo("b", "G1")}
    for ranks in (one_gpu, own_gpus, hier):
        b.plane.device_plans[ranks] = plan([infos[r] for r in ranks], nccl=True)
    b.plane.device_plans[(1, 3)] = plan([infos[1], infos[3]], nccl=False)

    def pick(ranks, op=pb.ALLREDUCE):
        return b.pick(op, Group.of(ranks, 0 if 0 in ranks else ranks[0]), 1 << 20,
                      memory="cuda").name
    if shm.available():
        assert pick(one_gpu) == "cuda_ipc"
    for op in (pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL, pb.REDUCESCATTER):
        assert pick(own_gpus, op) == "nccl"
    assert b.plane.device_plans[own_gpus].path == "nccl"
    assert b.plane.device_plans[hier].path == "hierarchical"
    assert [pick(hier, op) for op in (pb.ALLREDUCE, pb.BROADCAST, pb.ALLGATHER, pb.ALLTOALL,
                                      pb.REDUCESCATTER)] == ["cuda_ipc+nccl"] * 2 + ["staged"] * 3
    assert pick((1, 3)) == "staged"   # NCCL not loadable everywhere: the host
    nvlink = {r: DeviceInfo(hosts[r], f"G{r % 2}", frozenset({f"G{1 - r % 2}"}))
              for r in range(4)}
    b.plane.device_plans[hier] = plan([nvlink[r] for r in hier], nccl=True)
    assert pick(hier) == "nccl" and b.plane.device_plans[hier].islands == ((0, 1), (2, 3))
    with pytest.raises(RuntimeError, match="no backend"):
        pick((2, 3))   # no plan agreed for this group
    assert b.backends[0].config.nccl == "auto"
    assert _backends(hosts, DDL_NCCL="off").plane.config.nccl == "off"
    assert _backends(hosts, DDL_NCCL="on").plane.config.nccl == "on"


def _allreduce(name, count, dtype=pb.FLOAT32, op=pb.SUM):
    r = pb.Response(op=pb.ALLREDUCE, dtype=dtype, reduce_op=op)
    r.tensors.add(name=name, shape=[count])
    return r


@pytest.mark.parametrize("threshold", [0, 40, 64, 1 << 20])
def test_cycles_fuse_as_the_leader_does(threshold):
    """The cache cycles and the leader cut the same ready list into the same groups."""
    templates = [_allreduce("a", 4), _allreduce("b", 4, pb.FLOAT16), _allreduce("c", 4),
                 _allreduce("d", 20), _allreduce("e", 4, pb.FLOAT16),
                 _allreduce("f", 2, op=pb.MAX), _allreduce("g", 2)]
    ready = [ReadyItem(pb.Response.FromString(t.SerializeToString()), (0,))
             for t in templates]
    leader = [[t.name for t in item.response.tensors]
              for item in flush(ready, threshold, iter(range(1, 100)).__next__)]
    calls = [types.SimpleNamespace(template=t, op=t.op, count=int(t.tensors[0].shape[0]))
             for t in templates]
    before = [t.SerializeToString() for t in templates]
    runner = types.SimpleNamespace(_fusion_threshold=lambda: threshold)
    cycles = [[t.name for t in r.tensors] for r in CycleRunner._responses(runner, calls)]
    assert cycles == leader
    assert [t.SerializeToString() for t in templates] == before  # templates untouched
    if threshold == 40:
        assert leader == [["a", "c", "g"], ["b", "e"], ["d"], ["f"]]


def test_fusion_default_is_the_config_tables():
    from ddl.core.fusion import DEFAULT_THRESHOLD
    from ddl.server.leader import Leader
    assert DEFAULT_THRESHOLD == _config.var("DDL_FUSION_THRESHOLD").default
    assert Leader(1).fusion_threshold == DEFAULT_THRESHOLD
