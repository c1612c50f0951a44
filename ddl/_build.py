"""What this build of ddl has, asked as Horovod's scripts ask (``hvd.nccl_built()`` and
friends); every client re-exports these. Each answer is local and needs no ``init``.

ddl moves bytes over its own shared-memory and TCP data planes: it has no Gloo, and until
the GPU data plane lands no NCCL, CUDA, ROCm or oneCCL path (CUDA tensors are staged
through host memory). MPI is a way to start (``mpi_built`` is in :mod:`ddl.startup.mpi`).
"""

from __future__ import annotations


def gloo_built() -> bool:
    """False: ddl's collectives run over its own data planes, not Gloo."""
    return False


def nccl_built() -> bool:
    """False: no NCCL data path in this build (GPU tensors are staged through the host)."""
    return False


def cuda_built() -> bool:
    """False: no device-memory data path in this build (CUDA tensors are staged through
    the host, so they work, one copy each way)."""
    return False


def rocm_built() -> bool:
    """False: no ROCm data path."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL data path."""
    return False
