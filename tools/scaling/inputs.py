"""The published figures the model is checked against, and every assumption it makes,
each with where it comes from. Nothing here is fitted: fitted values live in
docs/scaling/fitted.json (see :mod:`.fit` and :mod:`.measure`)."""

from __future__ import annotations

GB = 1e9

# -- the published run (the project's source documents) --------------------------------
# "128 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network ...
# 90% scaling efficiency for both Inception V3 and ResNet-101, and 68% scaling
# efficiency for VGG-16" (512 GPUs, TensorFlow, synthetic data).
PUBLISHED_HOSTS = 128
PUBLISHED_GPUS_PER_HOST = 4
PUBLISHED_LINK_BITS = 25e9
PUBLISHED_EFFICIENCY = {"inception_v3": 0.90, "resnet101": 0.90, "vgg16": 0.68}

# -- single-GPU throughputs (images/s, batch 64, synthetic data) ------------------------
# TensorFlow's published tf_cnn_benchmarks results for one P100 (NVIDIA DGX-1):
# InceptionV3 142, ResNet-50 219, ResNet-152 91, VGG16 144. ResNet-101 is not in that
# table: its time per image is interpolated between ResNet-50's and ResNet-152's in
# proportion to FLOPs (profiles.json), see :func:`images_per_second`.
P100_IMAGES_PER_SECOND = {"inception_v3": 142.0, "resnet50": 219.0, "resnet152": 91.0,
                          "vgg16": 144.0}
BATCH = 64

# -- hardware assumptions ----------------------------------------------------------------
# Between the 4 GPUs of a host: PCIe 3.0 x16 behind one switch, ~10 GB/s per direction
# for a GPU ring (NCCL over PCIe), 5 µs per step.
PCIE_BYTES_PER_S = 10 * GB
PCIE_ALPHA_S = 5e-6
# Between hosts: a NCCL/RDMA ring step costs 10 µs of latency (RoCE, 2017); the share of
# the line rate it reaches (``link_efficiency``) is fitted to VGG-16's published 68 %.
NET_ALPHA_S = 10e-6

# -- the 2017 runtime (Horovod 0.9-0.11 with NCCL 2.0) -------------------------------------
# Tensor Fusion buffer 64 MiB; negotiation every 5 ms cycle (HOROVOD_CYCLE_TIME), so a
# ready buffer waits half a cycle on average, plus an MPI gather and broadcast of the
# ready names (2·log2(p) steps of 10 µs); one flat NCCL ring through all 512 GPUs.
HOROVOD_FUSION_BYTES = 64 * 2**20
HOROVOD_CYCLE_S = 5e-3
MPI_ALPHA_S = 10e-6

# -- ddl ---------------------------------------------------------------------------------
# Fusion threshold (DDL_FUSION_THRESHOLD default); no cycle time: ddl negotiates when
# a tensor is ready, and in steady state the response cache's vote round replaces the
# leader (ddl/runtime/cycles.py): a shared-memory round on one host, a recursive-doubling
# round over TCP across hosts, whose α is fitted from ddl's benchmark on the test hosts.
DDL_FUSION_BYTES = 64 * 2**20

GPU_COUNTS = (8, 64, 512)  # the predictions' sizes (4 GPUs per host)
PLOT_GPU_COUNTS = (4, 8, 16, 32, 64, 128, 256, 512)


def images_per_second(name: str, flops: dict) -> float:
    """One P100's throughput for ``name`` (see P100_IMAGES_PER_SECOND)."""
    if name in P100_IMAGES_PER_SECOND:
        return P100_IMAGES_PER_SECOND[name]
    if name != "resnet101":
        raise KeyError(name)
    lo, hi = "resnet50", "resnet152"
    t_lo, t_hi = 1 / P100_IMAGES_PER_SECOND[lo], 1 / P100_IMAGES_PER_SECOND[hi]
    share = (flops[name] - flops[lo]) / (flops[hi] - flops[lo])
    return 1 / (t_lo + share * (t_hi - t_lo))
