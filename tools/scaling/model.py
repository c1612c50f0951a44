"""α-β costs of ddl's collective algorithms, and the time of one data-parallel step.

A message step between two ranks costs ``alpha + bytes * beta`` (``alpha``: the start-up
latency, seconds; ``beta``: seconds per byte, the inverse of the bandwidth). Costs are for
an allreduce of ``nbytes`` on ``p`` ranks; reduction arithmetic is folded into ``beta``
(the fits measure it together with the copies).

The step model (:func:`step`): forward, then backward, during which each layer's
gradients become ready when its backward pass is done (a layer's backward time is taken
as proportional to its FLOPs). Reductions run one after another (one stream of
collectives, as in Horovod and ddl); each takes everything ready and not yet sent, fused
up to ``fusion_bytes``, and pays the runtime's per-operation overhead (negotiation) on
top of its α-β cost. The step ends when both the compute and the last reduction are
done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Tuple


@dataclass(frozen=True)
class Link:
    """The cost of one message step: ``alpha`` s plus ``beta`` s per byte."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return 1.0 / self.beta


def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Reduce-scatter then allgather around a ring: 2(p-1) steps of nbytes/p each."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def recursive_doubling_allreduce(nbytes: float, p: int, link: Link) -> float:
    """log2(p) rounds, each exchanging the whole buffer (ddl's small-message algorithm
    between hosts, and its cycles' vote rounds)."""
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * (link.alpha + nbytes * link.beta)


def shared_memory_allreduce(nbytes: float, p: int, link: Link) -> float:
    """ddl's one-host algorithm: every rank reduces its 1/p slice from all ranks'
    buffers, then copies out the others' slices; it has the ring's bandwidth term and
    two synchronisations (``link`` is the fitted shared-memory one)."""
    if p <= 1:
        return 0.0
    return 2 * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def hierarchical_allreduce(nbytes: float, hosts: int, per_host: int, intra: Link,
                           inter: Link) -> float:
    """Reduce-scatter within each host, allreduce of each 1/per_host slice across hosts
    (per_host rings at once, sharing the host's link: each slice ring sees 1/per_host of
    its bandwidth), allgather within each host."""
    inside = ring_allreduce(nbytes, per_host, intra)  # reduce-scatter + allgather
    shared = Link(inter.alpha, inter.beta * per_host)
    across = ring_allreduce(nbytes / per_host, hosts, shared)
    return inside + across


def flat_ring_allreduce(nbytes: float, hosts: int, per_host: int, intra: Link,
                        inter: Link) -> float:
    """One ring through every GPU (NCCL 2's rings in 2017): 2(p-1) steps, each as slow as
    its slowest hop, which is a host-to-host hop when there is more than one host."""
    p = hosts * per_host
    if p <= 1:
        return 0.0
    hop = inter if hosts > 1 else intra
    return 2 * (p - 1) * hop.alpha + 2 * (p - 1) / p * nbytes * hop.beta


@dataclass(frozen=True)
class Workload:
    """One model's training step on one GPU."""

    name: str
    layers: Tuple[Tuple[int, float], ...]  # (parameters, FLOPs) per layer, forward order
    images_per_second: float  # one GPU, alone
    batch: int  # per GPU
    bytes_per_parameter: int = 4
    backward_share: float = 2.0 / 3.0  # backward's share of the step's compute

    @property
    def parameters(self) -> int:
        return sum(p for p, _ in self.layers)

    @property
    def compute_s(self) -> float:
        return self.batch / self.images_per_second


@dataclass(frozen=True)
class Cluster:
    hosts: int
    gpus_per_host: int
    intra: Link  # between GPUs of one host
    inter: Link  # between hosts (the host's link)
    # relative spread (standard deviation / mean) of one GPU's compute time per step: a
    # step waits for the slowest of p GPUs, about sqrt(2 ln p) spreads above the mean
    jitter: float = 0.0

    def slowest(self, seconds: float) -> float:
        """The expected slowest GPU's time for work of ``seconds`` on average."""
        if self.gpus <= 1:
            return seconds
        return seconds * (1 + self.jitter * math.sqrt(2 * math.log(self.gpus)))

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host


@dataclass(frozen=True)
class Runtime:
    """What the collective library adds: how it reduces, how it fuses, how often it
    negotiates, and what each fused operation costs beyond its bytes."""

    name: str
    allreduce: Callable[[float, Cluster], float]
    op_overhead: Callable[[Cluster], float]  # seconds per fused operation
    fusion_bytes: float
    cycle_s: float = 0.0  # 0: event-driven (ddl); else ready tensors wait for a cycle tick


def ready_times(workload: Workload, compute: float) -> List[Tuple[float, float]]:
    """(seconds from the step's start, bytes) of each layer's gradients, in the order
    they become ready, for a step of ``compute`` seconds: backward runs the layers in
    reverse, each taking a share of the backward time proportional to its FLOPs."""
    forward = compute * (1 - workload.backward_share)
    backward = compute * workload.backward_share
    total_flops = sum(f for _, f in workload.layers) or 1.0
    out, done = [], 0.0
    for params, flops in reversed(workload.layers):
        done += flops / total_flops
        if params:
            out.append((forward + done * backward, params * workload.bytes_per_parameter))
    return out


def step(workload: Workload, cluster: Cluster, runtime: Runtime) -> float:
    """Seconds per step on every GPU of ``cluster`` (see the module doc): whenever the
    collective stream is free (and, with a cycle, at the next tick), everything ready
    and not yet sent goes in one fused operation of at most ``fusion_bytes`` (a larger
    tensor alone)."""
    if cluster.gpus == 1:
        return workload.compute_s
    compute = cluster.slowest(workload.compute_s)  # everyone waits for the slowest
    ready = ready_times(workload, compute)
    overhead = runtime.op_overhead(cluster)
    t, i = 0.0, 0
    while i < len(ready):
        t = max(t, ready[i][0])
        if runtime.cycle_s:
            t = math.ceil(t / runtime.cycle_s) * runtime.cycle_s
        size = 0.0
        while (i < len(ready) and ready[i][0] <= t
               and (not size or size + ready[i][1] <= runtime.fusion_bytes)):
            size += ready[i][1]
            i += 1
        t += overhead + runtime.allreduce(size, cluster)
    return max(compute, t)


def efficiency(workload: Workload, cluster: Cluster, runtime: Runtime) -> float:
    """Scaling efficiency: one GPU's step time over the step time at ``cluster``'s size
    (throughput per GPU relative to one GPU alone)."""
    return workload.compute_s / step(workload, cluster, runtime)


def solve(f: Callable[[float], float], target: float, lo: float, hi: float,
          iters: int = 100) -> float:
    """x in [lo, hi] with f(x) == target, for f monotonic on the interval (bisection)."""
    f_lo = f(lo)
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < target) == (f_lo < target):
            lo, f_lo = mid, f(mid)
        else:
            hi = mid
    return (lo + hi) / 2
