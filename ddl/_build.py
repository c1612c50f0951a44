"""What this build of ddl has, asked as Horovod's scripts ask (``hvd.nccl_built()`` and
friends); every client re-exports these. Each answer is local and needs no ``init``.

ddl moves bytes over its own shared-memory and TCP data planes and, for device arrays,
CUDA IPC and NCCL where CuPy brings them: it has no Gloo, ROCm, SYCL or oneCCL path. MPI is a
way to start (``mpi_built`` is in :mod:`ddl.startup.mpi`).
"""

from __future__ import annotations


def gloo_built() -> bool:
    """False: ddl's collectives run over its own data planes, not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: no ddl job runs its collectives over Gloo (Horovod: whether Gloo runs this
    job's). Needs no ``init``."""
    return False


def nccl_built() -> bool:
    """Whether device arrays of ranks on GPUs that cannot map each other's memory can move
    over NCCL here (CuPy, a CUDA device and an NCCL library load; docs/gpu.md); False: they
    are staged through the host. Imports CuPy, where it is installed, to ask."""
    from ddl.runtime import device_arrays
    return device_arrays.nccl_available()


def cuda_built() -> bool:
    """Whether CUDA arrays stay on their device (the device data plane: CuPy and a CUDA
    device are there, docs/gpu.md); False: they are staged through the host, one copy
    each way. Imports CuPy, where it is installed, to ask."""
    from ddl.runtime import device_arrays
    return device_arrays.available()


def rocm_built() -> bool:
    """False: no ROCm data path."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL data path."""
    return False


def sycl_built() -> bool:
    """False: no SYCL data path."""
    return False


def ddl_built() -> bool:
    """False: Horovod's question whether it was built with IBM's DDL library (another
    project that shares this one's name), which ddl does not use."""
    return False
