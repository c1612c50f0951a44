"""Which device data path a group of ranks holding GPU arrays takes: the selection rule.

Every member learns every member's :class:`DeviceInfo` (its host, its GPU's UUID, and the
GPUs its own can reach with peer access) in one exchange when the group first moves
device arrays, and then calls :func:`plan` with the same list: the answer is a pure
function of it, so it is the same on every member (the backend contract's rule for
``supports``). The rules:

* **IPC islands.** Ranks of one host whose GPUs can map each other's memory form an
  island: the same GPU (any number of ranks may share one), or GPUs with peer access
  both ways. Within an island, bytes move over CUDA IPC with device kernels.
* **One island**: the path is ``"ipc"``; with ``prefer_nccl`` (``DDL_NCCL=on``) and NCCL
  available, ``"nccl"`` instead when no two members share a GPU.
* **Several islands**, with NCCL available: ``"nccl"`` when no two members share a GPU
  (one flat communicator: NCCL itself takes NVLink or PCIe peer paths between the GPUs
  of one host, as under Horovod), else ``"hierarchical"``: IPC within each island, NCCL
  among one leader per island (its first member). NCCL refuses two ranks on one GPU, so
  a plan never puts two ranks of one GPU into one NCCL communicator; when the leaders
  would share a GPU (two islands of one host that cannot reach each other but share a
  GPU, which peer access that holds one way only can produce) the path is ``"host"``.
* Otherwise ``"host"``: the arrays are staged through host memory and take the host data
  paths (shared memory, TCP); ``reason`` says why, for the one-time notice.

A GPU is its UUID on its host: the same string on two hosts is two GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import FrozenSet, List, Sequence, Tuple

IPC, NCCL, HIERARCHICAL, HOST = "ipc", "nccl", "hierarchical", "host"


@dataclass(frozen=True)
class DeviceInfo:
    """One member's device: ``host`` as the job names it, ``uuid`` of its GPU (the same
    string in every process that sees that GPU), and ``peers``: the UUIDs of the GPUs its
    GPU can access directly, as this member's process sees them (only GPUs visible to
    it can be asked about)."""

    host: str
    uuid: str
    peers: FrozenSet[str] = field(default_factory=frozenset)

    def reaches(self, other: "DeviceInfo") -> bool:
        """Whether this member can map ``other``'s device memory (and it this one's)."""
        if self.host != other.host:
            return False
        return self.uuid == other.uuid or (other.uuid in self.peers
                                           and self.uuid in other.peers)


@dataclass(frozen=True)
class DevicePlan:
    """``path`` (:data:`IPC`, :data:`NCCL`, :data:`HIERARCHICAL` or :data:`HOST`),
    ``islands``: member indices per IPC island in member order (each island's first
    member is its NCCL leader), and ``reason``: one sentence on why."""

    path: str
    islands: Tuple[Tuple[int, ...], ...]
    reason: str

    @property
    def leaders(self) -> Tuple[int, ...]:
        """The member index that speaks NCCL for each island."""
        return tuple(island[0] for island in self.islands)


def islands(members: Sequence[DeviceInfo]) -> Tuple[Tuple[int, ...], ...]:
    """The IPC islands of ``members``: each member joins the first island (in order of
    their first member) all of whose members it reaches, else starts a new one."""
    found: List[List[int]] = []
    for k, info in enumerate(members):
        for island in found:
            if all(info.reaches(members[j]) for j in island):
                island.append(k)
                break
        else:
            found.append([k])
    return tuple(tuple(island) for island in found)


def plan(members: Sequence[DeviceInfo], nccl: bool,
         prefer_nccl: bool = False) -> DevicePlan:
    """The device data path for a group whose members' devices are ``members`` (member
    order); ``nccl``: whether every member can load NCCL (the same version, agreed in the
    same exchange); ``prefer_nccl``: whether every member asked for NCCL wherever it can
    run (``DDL_NCCL=on``), one island of distinct GPUs included."""
    if not members:
        raise ValueError("device plan: a group has at least one member")
    groups = islands(members)
    gpus = [(m.host, m.uuid) for m in members]
    distinct = len(members) > 1 and len(set(gpus)) == len(gpus)
    if len(groups) == 1 and not (nccl and prefer_nccl and distinct):
        return DevicePlan(IPC, groups, _one_island_reason(members))
    if not nccl:
        return DevicePlan(HOST, groups,
                          f"{len(groups)} groups of ranks cannot map each other's device "
                          f"memory and NCCL is not available to every rank; device arrays "
                          f"are staged through host memory")
    if distinct:
        where = len({m.host for m in members})
        return DevicePlan(NCCL, groups, f"{len(members)} ranks, each on a GPU of its own, "
                                        f"on {where} host(s): one NCCL communicator")
    leaders = [gpus[island[0]] for island in groups]
    shared = sorted({uuid for host, uuid in leaders if leaders.count((host, uuid)) > 1})
    if shared:
        return DevicePlan(HOST, groups,
                          f"ranks that cannot map each other's memory share GPU "
                          f"{shared[0]}, and NCCL refuses two ranks on one GPU; device "
                          f"arrays are staged through host memory")
    return DevicePlan(HIERARCHICAL, groups,
                      f"CUDA IPC within {len(groups)} groups of ranks that map each "
                      f"other's memory, NCCL among one rank of each")


def _one_island_reason(members: Sequence[DeviceInfo]) -> str:
    gpus = len({m.uuid for m in members})
    if gpus == 1:
        return f"{len(members)} rank(s) on one GPU"
    return f"{len(members)} ranks on {gpus} GPUs of one host with peer access"
