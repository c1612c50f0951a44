"""The device data path's selection rule (ddl.dataplane.backends.device_plan): pure, so the
same list gives the same plan on every member; every GPU layout a job can have."""

import pytest

from ddl.dataplane.backends.device_plan import (HIERARCHICAL, HOST, IPC, NCCL, DeviceInfo,
                                                islands, plan)


def gpu(host, uuid, *peers):
    return DeviceInfo(host, uuid, frozenset(peers))


def test_ranks_sharing_one_gpu_use_ipc_and_never_nccl():
    members = [gpu("a", "GPU-0")] * 4
    for nccl in (True, False):
        p = plan(members, nccl)
        assert p.path == IPC and p.islands == ((0, 1, 2, 3),)
        assert "4 rank(s) on one GPU" in p.reason


def test_peer_gpus_of_one_host_form_one_island_only_with_access_both_ways():
    both = [gpu("a", "GPU-0", "GPU-1"), gpu("a", "GPU-1", "GPU-0")]
    assert plan(both, nccl=True).path == IPC
    assert "2 GPUs of one host with peer access" in plan(both, nccl=True).reason
    one_way = [gpu("a", "GPU-0", "GPU-1"), gpu("a", "GPU-1")]
    assert islands(one_way) == ((0,), (1,))
    assert plan(one_way, nccl=True).path == NCCL
    p = plan(one_way, nccl=False)
    assert p.path == HOST and "NCCL is not available" in p.reason


def test_gpus_on_different_hosts_take_nccl_flat_or_hierarchical():
    flat = [gpu("a", "GPU-0"), gpu("b", "GPU-1"), gpu("c", "GPU-2")]
    p = plan(flat, nccl=True)
    assert (p.path, p.islands, p.leaders) == (NCCL, ((0,), (1,), (2,)), (0, 1, 2))
    assert "3 ranks, each on a GPU of its own, on 3 host(s)" in p.reason
    # two hosts of two peer GPUs each, a rank per GPU (the usual GPU cluster): IPC islands
    # exist, but one flat NCCL communicator carries them (NCCL takes NVLink within a host)
    nvlink = [gpu("a", "GPU-0", "GPU-1"), gpu("a", "GPU-1", "GPU-0"),
              gpu("b", "GPU-0", "GPU-1"), gpu("b", "GPU-1", "GPU-0")]
    p = plan(nvlink, nccl=True)
    assert (p.path, p.islands) == (NCCL, ((0, 1), (2, 3)))
    assert "4 ranks, each on a GPU of its own, on 2 host(s)" in p.reason
    assert plan(nvlink, nccl=False).path == HOST
    # two ranks per host on one GPU each host: IPC inside, NCCL between the hosts' leaders
    hier = [gpu("a", "GPU-0"), gpu("a", "GPU-0"), gpu("b", "GPU-1"), gpu("b", "GPU-1")]
    p = plan(hier, nccl=True)
    assert (p.path, p.islands, p.leaders) == (HIERARCHICAL, ((0, 1), (2, 3)), (0, 2))
    # one shared GPU anywhere is enough to rule the flat communicator out
    one_shared = [gpu("a", "GPU-0"), gpu("a", "GPU-0"), gpu("b", "GPU-1"), gpu("c", "GPU-2")]
    assert plan(one_shared, nccl=True).path == HIERARCHICAL
    # members interleaved across hosts: islands keep member order, leaders are first members
    mixed = [gpu("a", "GPU-0"), gpu("b", "GPU-1"), gpu("a", "GPU-0"), gpu("b", "GPU-1")]
    assert plan(mixed, nccl=True).islands == ((0, 2), (1, 3))
    assert plan(mixed, nccl=True).leaders == (0, 1)
    # the same UUID string on two hosts is not one GPU: hosts never share an island, and
    # the flat communicator is allowed
    assert islands([gpu("a", "GPU-0"), gpu("b", "GPU-0")]) == ((0,), (1,))
    assert plan([gpu("a", "GPU-0"), gpu("b", "GPU-0")], nccl=True).path == NCCL


def test_ddl_nccl_on_prefers_nccl_within_one_host_only_for_distinct_gpus():
    peers = [gpu("a", "GPU-0", "GPU-1"), gpu("a", "GPU-1", "GPU-0")]
    assert plan(peers, nccl=True).path == IPC
    p = plan(peers, nccl=True, prefer_nccl=True)
    assert (p.path, p.islands) == (NCCL, ((0, 1),))
    assert "2 ranks, each on a GPU of its own, on 1 host(s)" in p.reason
    assert plan(peers, nccl=False, prefer_nccl=True).path == IPC   # NCCL not everywhere
    shared = [gpu("a", "GPU-0"), gpu("a", "GPU-0")]
    assert plan(shared, nccl=True, prefer_nccl=True).path == IPC   # NCCL refuses those
    assert plan([gpu("a", "GPU-0")], nccl=True, prefer_nccl=True).path == IPC


def test_two_islands_sharing_a_gpu_never_reach_nccl():
    # rank 2 sees only its own GPU, so it cannot reach rank 1's; it shares GPU-0 with the
    # first island's leader, and NCCL refuses two ranks on one GPU
    members = [gpu("a", "GPU-0", "GPU-1"), gpu("a", "GPU-1", "GPU-0"), gpu("a", "GPU-0")]
    assert islands(members) == ((0, 1), (2,))
    p = plan(members, nccl=True)
    assert p.path == HOST and "share GPU GPU-0" in p.reason and "NCCL refuses" in p.reason


def test_plan_is_a_pure_function_of_the_list():
    members = [gpu("b", "GPU-3"), gpu("a", "GPU-0"), gpu("a", "GPU-0")]
    assert plan(list(members), True) == plan(tuple(members), True)
    assert plan(members, True).islands == ((0,), (1, 2))
    with pytest.raises(ValueError):
        plan([], True)
