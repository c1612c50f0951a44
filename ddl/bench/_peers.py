"""ddl-bench's --compare implementations: torch.distributed (Gloo, NCCL) and mpi4py, run
in the same processes on the same buffers as ddl."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Dict, Sequence

import numpy as np

import ddl
from ddl.bench._cases import Case
from ddl.bench._devices import device_sync, to_torch
from ddl.bench._timing import Runner
from ddl.startup import mpi as _mpi

# Dtypes torch's Gloo backend reduces and moves (it rejects int16 and uint16).
GLOO_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32",
               "int64")
# Dtypes with a standard MPI datatype (MPI has none for float16 and bfloat16).
MPI_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64")
# Dtypes NCCL reduces and moves, of those --device cuda makes (CuPy has no bfloat16).
NCCL_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
# --reduce-op's names in torch.distributed.ReduceOp and in mpi4py's MPI
_TORCH_REDUCE_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX"}
_MPI_REDUCE_OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX"}
# Implementations --compare can run beside ddl, in this order.
PEERS = ("gloo", "mpi", "nccl")


class CompareError(RuntimeError):
    """A --compare implementation cannot run in this job (the same on every rank)."""


# -- torch.distributed: Gloo, NCCL ----------------------------------------------------------

class TorchDist:
    """torch.distributed with ``backend`` (``"gloo"`` or ``"nccl"``), in this process, on
    the ddl job's ranks: the first one started makes the default process group (at
    :func:`_torch_rendezvous`), a later one a group of its own. NCCL takes the GPU the
    inputs are on and refuses two ranks on one GPU: then the constructor raises
    CompareError on every rank."""

    def __init__(self, backend: str) -> None:
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.name = torch, dist, backend
        self.dtypes = GLOO_DTYPES if backend == "gloo" else NCCL_DTYPES
        if backend == "nccl":
            device = ddl.local_rank() % torch.cuda.device_count()
            _one_rank_per_gpu(device)
            torch.cuda.set_device(device)
        if ddl.local_size() != ddl.size():
            _pin_interface()
        self.group = None   # the default group
        if dist.is_initialized():
            self.group = dist.new_group(backend=backend)
        else:
            dist.init_process_group(backend, init_method=_torch_rendezvous(),
                                    rank=ddl.rank(), world_size=ddl.size(),
                                    timeout=datetime.timedelta(seconds=300))
        # Newer torch names them *_single; older torch has only the *_tensor names.
        self._all_gather = getattr(dist, "all_gather_single", None) or \
            dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or \
            dist.reduce_scatter_tensor

    def close(self) -> None:
        self.dist.destroy_process_group(self.group)

    def describe(self) -> str:
        version = ""
        if self.name == "nccl":   # (a tuple; an int from older torch)
            found = self.torch.cuda.nccl.version()
            version = ", NCCL " + (".".join(map(str, found)) if isinstance(found, tuple)
                                   else str(found))
        return (f"torch.distributed {'Gloo' if self.name == 'gloo' else 'NCCL'} (torch "
                f"{self.torch.__version__}{version}), in place")

    def runner(self, case: Case, x: np.ndarray, expected: np.ndarray,
               device: Any = None) -> Runner:
        """The torch op of ``case`` on tensors of ``x`` (on ``device``, else views of the
        host arrays): reads ``x``, writes an output shaped like ``expected``, which
        ``reset`` fills with values that differ from it everywhere, so a call that writes
        nothing is caught."""
        dist, op, group = self.dist, case.op, self.group
        red = getattr(dist.ReduceOp, _TORCH_REDUCE_OPS[case.reduce_op])
        if op in ("allreduce", "broadcast"):  # in place: reset the buffer to the input
            source = to_torch(x, device)
            t = source.clone()
            call = (lambda: dist.all_reduce(t, op=red, group=group)) if op == "allreduce" \
                else (lambda: dist.broadcast(t, src=0, group=group))
            return Runner(lambda: (call(), t)[1], lambda: t.copy_(source), device_sync(t))
        poison = to_torch((expected == 0).astype(case.dtype), device)
        t_in, t_out = to_torch(x, device), poison.clone()
        calls = {
            "allgather": lambda: self._all_gather(t_out, t_in, group=group),
            "alltoall": lambda: dist.all_to_all_single(t_out, t_in, group=group),
            "reducescatter": lambda: self._reduce_scatter(t_out, t_in, op=red, group=group),
        }
        call = calls[op]
        return Runner(lambda: (call(), t_out)[1], lambda: t_out.copy_(poison),
                      device_sync(t_out))


def _one_rank_per_gpu(device: int) -> None:
    """CompareError on every rank when two ranks of the job are on one GPU (NCCL refuses
    them: ``ncclInvalidUsage``, duplicate GPU), naming both ranks and the GPU."""
    from ddl.runtime import device_arrays as cuda
    uuid = cuda.device_info(device)[0].encode()[:64].ljust(64)
    got = ddl.allgather(np.frombuffer(uuid, np.uint8).reshape(1, 64),
                        name="ddl-bench/nccl-gpus")
    first: Dict[bytes, int] = {}
    for rank, row in enumerate(np.asarray(got).reshape(ddl.size(), 64)):
        key = bytes(row)
        if key in first:
            raise CompareError(
                f"--compare nccl: ranks {first[key]} and {rank} are on the same GPU "
                f"({key.decode().strip()}), and NCCL refuses two ranks on one GPU; run "
                f"one rank per GPU (-np at most the GPUs), or compare with gloo")
        first[key] = rank


def _torch_rendezvous() -> str:
    """torch.distributed's ``tcp://`` rendezvous, the same on every rank: a free port of
    rank 0's on 127.0.0.1 where the job is on one host, else on the address its data
    plane listens on, which the other hosts reach (rank 0 broadcasts it with ddl)."""
    raw = np.zeros(256, np.uint8)
    if ddl.rank() == 0:
        host = "127.0.0.1"
        if ddl.local_size() != ddl.size():
            host = _data_plane_host(0)
            try:
                socket.getaddrinfo(host or None, 0)
            except OSError:
                host = ""
            host = host or socket.gethostbyname(socket.gethostname())
        text = f"[{host}]" if ":" in host else host
        text = f"tcp://{text}:{_free_port(host)}".encode()
        raw[:len(text)] = np.frombuffer(text, np.uint8)
    got = ddl.broadcast(raw, root_rank=0, name="ddl-bench/torch-rendezvous")
    return bytes(np.asarray(got)).rstrip(b"\0").decode()


def _data_plane_host(rank: int) -> str:
    """The address ``rank``'s data plane listens on (the one other hosts reach), or ""."""
    from ddl.runtime import runtime as _runtime
    try:
        return _runtime.runtime().transport.address_of(rank).rpartition(":")[0].strip("[]")
    except AttributeError:   # (a transport without addresses)
        return ""


def _pin_interface() -> None:
    """A job on several hosts: Gloo's and NCCL's sockets on the interface of this rank's
    data plane (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless set), not the one
    the host name resolves to, which may be loopback."""
    from ddl.launcher._probe import interface_of
    name = interface_of(_data_plane_host(ddl.rank()))
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def _free_port(host: str) -> int:
    """A TCP port on ``host`` (an address of this machine) that is free now."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# -- MPI ------------------------------------------------------------------------------------

class Mpi:
    """mpi4py on a duplicate of ``MPI.COMM_WORLD``, whose ranks must be the ddl job's in
    the same order (true when MPI started the job and ddl-bench called ``ddl.init()``).
    Raises CompareError on every rank when they are not."""

    name = "mpi"
    dtypes = MPI_DTYPES

    def __init__(self) -> None:
        self.MPI = MPI = _mpi.import_mpi()
        world = MPI.COMM_WORLD
        size, rank = world.Get_size(), world.Get_rank()
        mismatch = np.array([int(size != ddl.size() or rank != ddl.rank())], np.int64)
        if ddl.allreduce(mismatch, op=ddl.Sum, name="ddl-bench/mpi-world")[0]:
            raise CompareError(
                f"--compare mpi: MPI.COMM_WORLD has {size} ranks (this is rank {rank}) and "
                f"the ddl job {ddl.size()} (rank {ddl.rank()}); start ddl-bench itself "
                f"under MPI (ddlrun --mpi -np N ddl-bench ... or mpiexec -n N ddl-bench ...) "
                f"so that they are the same ranks")
        self.comm = world.Dup()

    def close(self) -> None:
        self.comm.Free()

    def describe(self) -> str:
        import mpi4py
        library = " ".join(self.MPI.Get_library_version().strip().splitlines()[0].split())
        return f"mpi4py {mpi4py.__version__} on {library}, MPI.COMM_WORLD, out of place"

    def runner(self, case: Case, x: np.ndarray, expected: np.ndarray) -> Runner:
        """The MPI op of ``case``: reads ``x``, writes an output array shaped like
        ``expected``, which ``reset`` fills with values that differ from it everywhere
        (broadcast, in place: with this rank's input)."""
        comm, red = self.comm, getattr(self.MPI, _MPI_REDUCE_OPS[case.reduce_op])
        out = np.empty_like(expected)
        if case.op == "broadcast":
            return Runner(lambda: (comm.Bcast(out, root=0), out)[1],
                          lambda: np.copyto(out, x))
        calls = {
            "allreduce": lambda: comm.Allreduce(x, out, op=red),
            "allgather": lambda: comm.Allgather(x, out),
            "alltoall": lambda: comm.Alltoall(x, out),
            "reducescatter": lambda: comm.Reduce_scatter_block(x, out, op=red),
        }
        call = calls[case.op]
        poison = (expected == 0).astype(case.dtype)
        return Runner(lambda: (call(), out)[1], lambda: np.copyto(out, poison))


# -- starting and closing them --------------------------------------------------------------

def start_peers(names: Sequence[str]) -> list:
    """The --compare implementations, started in order on every rank; those started
    before one that fails are closed again."""
    peers: list = []
    try:
        for name in names:
            peers.append(Mpi() if name == "mpi" else TorchDist(name))
    except BaseException:
        close_peers(peers)
        raise
    return peers


def close_peers(peers: Sequence[Any]) -> None:
    for peer in reversed(peers):
        peer.close()
