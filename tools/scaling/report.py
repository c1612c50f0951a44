"""The tables and the plot of docs/scaling.md, derived from the committed benchmark CSVs
(docs/scaling/data), the model profiles (docs/scaling/profiles.json) and the stated
inputs (:mod:`.inputs`). :func:`tables` is what tests/test_scaling.py compares with the
document, so the document cannot drift from the code."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, List

from . import fit, inputs, model, profiles
from .measure import DATA, LINK_BYTES_PER_S, ROOT

DOC = os.path.join(ROOT, "docs", "scaling.md")
PLOT = os.path.join(ROOT, "docs", "scaling", "efficiency.png")
BEGIN, END = "<!-- scaling tables: begin (python -m tools.scaling report) -->", \
    "<!-- scaling tables: end -->"
SMALL_MESSAGE_BYTES = 64 * 1024  # DDL_SMALL_MESSAGE_BYTES's default
NAMES = {"inception_v3": "Inception V3", "resnet101": "ResNet-101", "vgg16": "VGG-16"}


@dataclass
class Fitted:
    shm: model.Link
    tcp: model.Link  # loopback: ddl's own per-byte cost over TCP on this machine
    link: model.Link  # the shaped link between test hosts
    link_efficiency: float  # link bandwidth reached / the shaped rate
    link_efficiency_25g: float  # the published link's share (fitted to VGG-16)
    jitter: float  # fitted to ResNet-101


def fits() -> Dict[str, model.Link]:
    tcp_cost = fit.tcp_cost(SMALL_MESSAGE_BYTES)
    return {
        "shm": fit.fit(fit.read_rows(os.path.join(DATA, "shm_np2.csv")),
                       fit.shared_memory_cost),
        "tcp": fit.fit(fit.read_rows(os.path.join(DATA, "tcp_np2.csv")), tcp_cost),
        "link": fit.fit(fit.read_rows(os.path.join(DATA, "link_np2.csv")), tcp_cost),
    }


def workloads() -> Dict[str, model.Workload]:
    prof = profiles.load(os.path.join(ROOT, "docs", "scaling", "profiles.json"))
    flops = {k: sum(f for _, f in v) for k, v in prof.items()}
    return {k: model.Workload(k, prof[k], inputs.images_per_second(k, flops), inputs.BATCH)
            for k in inputs.PUBLISHED_EFFICIENCY}


def cluster(gpus: int, link_efficiency: float, jitter: float) -> model.Cluster:
    per_host = inputs.PUBLISHED_GPUS_PER_HOST
    return model.Cluster(
        hosts=max(1, gpus // per_host), gpus_per_host=min(gpus, per_host),
        intra=model.Link(inputs.PCIE_ALPHA_S, 1 / inputs.PCIE_BYTES_PER_S),
        inter=model.Link(inputs.NET_ALPHA_S,
                         8 / (link_efficiency * inputs.PUBLISHED_LINK_BITS)),
        jitter=jitter)


def horovod_2017() -> model.Runtime:
    return model.Runtime(
        "Horovod 2017 (model)",
        lambda n, c: model.flat_ring_allreduce(n, c.hosts, c.gpus_per_host, c.intra, c.inter),
        lambda c: 2 * math.ceil(math.log2(c.gpus)) * inputs.MPI_ALPHA_S,
        inputs.HOROVOD_FUSION_BYTES, inputs.HOROVOD_CYCLE_S)


def _ddl_overhead(f: Dict[str, model.Link]):
    """A fused operation's negotiation in steady state: the response cache's vote round
    (a shared-memory round on one host; recursive doubling over TCP across hosts, each
    round as long as a small allreduce between the test hosts)."""
    def overhead(c: model.Cluster) -> float:
        if c.hosts == 1:
            return 2 * f["shm"].alpha
        return math.ceil(math.log2(c.gpus)) * f["link"].alpha
    return overhead


def ddl_gpu(f: Dict[str, model.Link]) -> model.Runtime:
    """ddl's GPU path as designed (issue 17): CUDA IPC within a host and NCCL across, or
    one NCCL ring through every GPU, whichever is faster for the call (the backend seam
    picks per call). ddl's hierarchical stages run one after another (not pipelined), so
    for large buffers the flat ring, whose PCIe hops overlap its network hops, wins."""
    def allreduce(n: float, c: model.Cluster) -> float:
        return min(model.hierarchical_allreduce(n, c.hosts, c.gpus_per_host, c.intra, c.inter),
                   model.flat_ring_allreduce(n, c.hosts, c.gpus_per_host, c.intra, c.inter))
    return model.Runtime("ddl, GPU path (IPC + NCCL)", allreduce, _ddl_overhead(f),
                         inputs.DDL_FUSION_BYTES)


def ddl_host(f: Dict[str, model.Link], link_efficiency: float) -> model.Runtime:
    """ddl's path today: gradients copied to host memory and back over PCIe, shared
    memory within a host, ddl's TCP ring across hosts at the lesser of the link's share
    ddl reached on the shaped link and ddl's own TCP rate on this machine (loopback)."""
    def allreduce(n: float, c: model.Cluster) -> float:
        wire = link_efficiency * inputs.PUBLISHED_LINK_BITS / 8
        inter = model.Link(f["link"].alpha, max(1 / wire, f["tcp"].beta))
        staging = 2 * n / inputs.PCIE_BYTES_PER_S
        return staging + model.hierarchical_allreduce(n, c.hosts, c.gpus_per_host,
                                                      f["shm"], inter)
    return model.Runtime("ddl, host path today (shm + TCP)", allreduce, _ddl_overhead(f),
                         inputs.DDL_FUSION_BYTES)


def calibrate(w: Dict[str, model.Workload]) -> Fitted:
    """The published link's efficiency from VGG-16's 68 % and the compute jitter from
    ResNet-101's 90 % (jointly); Inception V3 is then the check."""
    gpus = inputs.PUBLISHED_HOSTS * inputs.PUBLISHED_GPUS_PER_HOST
    hvd = horovod_2017()

    def eta_for(jitter: float) -> float:
        return model.solve(lambda e: model.efficiency(w["vgg16"], cluster(gpus, e, jitter),
                                                      hvd),
                           inputs.PUBLISHED_EFFICIENCY["vgg16"], 0.05, 1.0)

    jitter = model.solve(
        lambda j: model.efficiency(w["resnet101"], cluster(gpus, eta_for(j), j), hvd),
        inputs.PUBLISHED_EFFICIENCY["resnet101"], 0.0, 0.2)
    f = fits()
    return Fitted(shm=f["shm"], tcp=f["tcp"], link=f["link"],
                  link_efficiency=(1 / f["link"].beta) / LINK_BYTES_PER_S,
                  link_efficiency_25g=eta_for(jitter), jitter=jitter)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def tables() -> str:
    """The markdown of docs/scaling.md between the markers."""
    w = workloads()
    c = calibrate(w)
    f = {"shm": c.shm, "tcp": c.tcp, "link": c.link}
    out: List[str] = []
    out.append("**Fitted from ddl's benchmark runs** (docs/scaling/data/*.csv):\n")
    out.append("| path | α | bandwidth (1/β) | worst row: measured / modelled |")
    out.append("|---|---|---|---|")
    tcp_cost = fit.tcp_cost(SMALL_MESSAGE_BYTES)
    for key, label, cost in (("shm", "shared memory, 2 ranks, one host", fit.shared_memory_cost),
                             ("tcp", "loopback TCP, 2 ranks, one host", tcp_cost),
                             ("link", "test hosts, link shaped to 1 Gbit/s", tcp_cost)):
        rows = fit.read_rows(os.path.join(DATA, f"{key}_np2.csv"))
        worst = max(fit.residuals(rows, cost, f[key]), key=lambda r: abs(math.log(r[1] / r[2])))
        out.append(f"| {label} | {f[key].alpha * 1e6:.1f} µs | "
                   f"{f[key].bandwidth / 1e9:.3f} GB/s | {worst[1] / worst[2]:.2f} "
                   f"(at {worst[0]} B) |")
    out.append(f"\nddl's TCP ring reached {_pct(c.link_efficiency)} of the shaped link's rate.\n")
    out.append("**The published run, modelled** (512 P100 GPUs, 128 hosts, 25 Gbit/s):\n")
    out.append("| model | parameters | 1 GPU img/s | published | model | used to |")
    out.append("|---|---|---|---|---|---|")
    gpus = inputs.PUBLISHED_HOSTS * inputs.PUBLISHED_GPUS_PER_HOST
    role = {"vgg16": "fit the link's efficiency", "resnet101": "fit the compute jitter",
            "inception_v3": "check"}
    hvd = horovod_2017()
    for k in ("inception_v3", "resnet101", "vgg16"):
        e = model.efficiency(w[k], cluster(gpus, c.link_efficiency_25g, c.jitter), hvd)
        out.append(f"| {NAMES[k]} | {w[k].parameters / 1e6:.1f} M | "
                   f"{w[k].images_per_second:.0f} | {_pct(inputs.PUBLISHED_EFFICIENCY[k])} | "
                   f"{_pct(e)} | {role[k]} |")
    out.append(f"\nFitted: the link reaches {_pct(c.link_efficiency_25g)} of 25 Gbit/s; "
               f"one GPU's step time varies by {_pct(c.jitter)} (standard deviation).\n")
    out.append("**Predicted efficiency** (4 GPUs per host, the same hardware and fits):\n")
    runtimes = [hvd, ddl_gpu(f), ddl_host(f, c.link_efficiency)]
    out.append("| model | runtime | " + " | ".join(f"{g} GPUs" for g in inputs.GPU_COUNTS) + " |")
    out.append("|---|---|" + "---|" * len(inputs.GPU_COUNTS))
    for k in ("inception_v3", "resnet101", "vgg16"):
        for rt in runtimes:
            cells = [_pct(model.efficiency(w[k], cluster(g, c.link_efficiency_25g, c.jitter),
                                           rt)) for g in inputs.GPU_COUNTS]
            out.append(f"| {NAMES[k]} | {rt.name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write_doc() -> None:
    text = open(DOC).read()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(DOC, "w") as fh:
        fh.write(text[:a] + "\n" + tables() + text[b:])


def plot(path: str = PLOT) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    w = workloads()
    c = calibrate(w)
    f = {"shm": c.shm, "tcp": c.tcp, "link": c.link}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    styles = {"inception_v3": "tab:blue", "resnet101": "tab:orange", "vgg16": "tab:green"}
    for k, color in styles.items():
        for rt, ls in ((ddl_gpu(f), "-"), (ddl_host(f, c.link_efficiency), ":"),
                       (horovod_2017(), "--")):
            ys = [100 * model.efficiency(w[k], cluster(g, c.link_efficiency_25g, c.jitter), rt)
                  for g in inputs.PLOT_GPU_COUNTS]
            ax.plot(inputs.PLOT_GPU_COUNTS, ys, ls, color=color,
                    label=f"{NAMES[k]}: {rt.name}")
        ax.plot([512], [100 * inputs.PUBLISHED_EFFICIENCY[k]], "o", color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(inputs.PLOT_GPU_COUNTS, [str(g) for g in inputs.PLOT_GPU_COUNTS])
    ax.set_xlabel("GPUs (4 per host, 25 Gbit/s between hosts)")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.set_title("Modelled efficiency; dots: published (Horovod, 512 P100)")
    ax.legend(fontsize=6, ncol=1, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)


def predict(parameters: float, compute_ms: float, hosts: int, gpus_per_host: int,
            link_gbit: float, layers: int = 50, link_efficiency: float = 0.0) -> str:
    """Predicted efficiency of a model of ``parameters`` (fp32 gradients, spread evenly
    over ``layers`` layers of equal FLOPs) taking ``compute_ms`` per step on one GPU, on
    ``hosts`` × ``gpus_per_host`` GPUs joined by ``link_gbit`` (reaching
    ``link_efficiency`` of it; 0: the share fitted to the published run), under each
    runtime, as text."""
    c = calibrate(workloads())
    f = {"shm": c.shm, "tcp": c.tcp, "link": c.link}
    eta = link_efficiency or c.link_efficiency_25g
    per = int(parameters) // layers
    w = model.Workload("custom", tuple((per, 1.0) for _ in range(layers)),
                       images_per_second=1000.0 / compute_ms, batch=1)
    cl = model.Cluster(hosts, gpus_per_host, model.Link(inputs.PCIE_ALPHA_S,
                                                        1 / inputs.PCIE_BYTES_PER_S),
                       model.Link(inputs.NET_ALPHA_S, 8 / (eta * link_gbit * 1e9)), c.jitter)
    lines = [f"{parameters / 1e6:.1f} M parameters, {compute_ms:g} ms per step, "
             f"{hosts} x {gpus_per_host} GPUs, {link_gbit:g} Gbit/s at {100 * eta:.1f} %:"]
    for rt in (ddl_gpu(f), ddl_host(f, c.link_efficiency), horovod_2017()):
        lines.append(f"  {rt.name}: {100 * model.efficiency(w, cl, rt):.1f} %")
    return "\n".join(lines) + "\n"
