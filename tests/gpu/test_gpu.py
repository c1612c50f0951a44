"""The GPU suite: device arrays (torch CUDA tensors, CuPy and JAX GPU arrays) through every
collective, training on CUDA, a rank killed mid-collective, and the CUDA benchmarks.

It needs a CUDA device (one GPU is enough: ranks share it) and skips everywhere else, so
the CPU suite stays as it is. On a GPU machine, from a checkout:

    python -m pytest -q tests/gpu

``tools/gpu_suite.sh`` installs the project on a lent GPU machine and runs this suite and
the CUDA benchmarks in one call.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

# JAX ranks share the GPU with torch ones, and a JAX probe in this process must not take
# most of its memory for the rest of the session
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
torch = pytest.importorskip("torch", reason="the GPU suite needs PyTorch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine: the GPU suite runs on a GPU machine "
                "(python -m pytest tests/gpu there, or tools/gpu_suite.sh)",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = os.path.join(ROOT, "tests", "gpu", "_gpu_checks.py")


def ddlrun(np_: int, *args: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    # from outside the checkout: its ddl/ (without ddl.server, which pyproject maps from
    # server/) must not shadow the installed ddl in the ranks and the coordinator
    return subprocess.run(["ddlrun", "-np", str(np_), *args], cwd=tempfile.gettempdir(),
                          env=full,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def checks(np_: int, *what: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return ddlrun(np_, sys.executable, CHECKS, *what, timeout=timeout)


def _ok(r: subprocess.CompletedProcess, np_: int, what: str) -> None:
    ok = r.stdout.count(f"GPU CHECKS OK {what}")
    assert r.returncode == 0 and ok == np_, r.stdout[-6000:] + r.stderr[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [2, 4])
def test_every_collective_on_cuda_tensors_bit_exact(np_):
    what = "collectives training"
    r = checks(np_, *what.split())
    _ok(r, np_, what)


@pytest.mark.timeout(300)
def test_cupy_arrays():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed here")
    _ok(checks(2, "cupy"), 2, "cupy")


@pytest.mark.timeout(300)
def test_cupy_example():
    """examples/cupy_allreduce.py with the real CuPy: 2 ranks sharing the GPU."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed here")
    r = ddlrun(2, sys.executable, os.path.join(ROOT, "examples", "cupy_allreduce.py"))
    done = re.findall(r"collectives OK; trained to within \S+ of the true weights -> OK",
                      r.stdout)
    assert r.returncode == 0 and len(done) == 2, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.timeout(300)
def test_jax_gpu_arrays():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed here")
    import jax  # noqa: F401  (a CPU-only JAX has no "gpu" devices)
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX here has no GPU backend")
    _ok(checks(2, "jax"), 2, "jax")


@pytest.mark.timeout(120)
def test_ranks_whose_device_slots_differ_get_a_mismatch_error():
    r = ddlrun(2, sys.executable, CHECKS, "slots", timeout=100)
    said = re.findall(r"SLOT MISMATCH: (.*)", r.stdout)
    assert r.returncode != 0 and len(said) == 2, r.stdout[-4000:] + r.stderr[-4000:]
    assert "MismatchError" in " ".join(said), said
    assert not re.search(r"<stdout>:rank \d+: ", r.stdout), r.stdout[-4000:]


@pytest.mark.timeout(120)
def test_nccl_communicator_of_one_gpu_runs_every_collective_and_aborts_at_its_deadline():
    """The NCCL backend's communicator (ddl.dataplane.device.nccl) on the one GPU a lent
    machine has: NCCL refuses two ranks on one GPU, so only a communicator of one member
    runs here. Every collective, the dtypes NCCL has no type for, then a wait that passes
    its deadline behind a spinning kernel: the communicator is aborted and stays broken.
    Min and Max on floats keep NaNs (gathered and reduced on the device)."""
    cp = pytest.importorskip("cupy", reason="the NCCL backend runs on CuPy")
    from ddl.core.dtypes import ReduceOp
    from ddl.dataplane.device import nccl
    if not nccl.available():
        pytest.skip("NCCL does not load through CuPy here")
    comm = nccl.NcclComm(nccl.unique_id(), 1, 0, 0, (0,), lambda: None).connect(
        time.monotonic() + 60)
    far = time.monotonic() + 60
    with cp.cuda.Device(0), cp.cuda.Stream(non_blocking=True):
        for dtype in ("float32", "float16", "int64", "int16", "uint16"):
            src = cp.arange(1000, dtype=dtype)
            out = cp.zeros_like(src)
            comm.allreduce(out, ReduceOp.Sum, far, src=src)
            assert bool((out == src).all()), dtype
        flags = cp.array([True, False, True])
        comm.allreduce(flags, ReduceOp.Max, far)
        assert flags.tolist() == [True, False, True]
        with pytest.raises(ValueError, match="bool"):
            comm.allreduce(flags, ReduceOp.Sum, far)
        block = cp.arange(10, dtype=cp.float32)
        block[3] = cp.nan
        comm.reducescatter(block, [10], ReduceOp.Max, far)
        assert bool(cp.isnan(block[3])) and block[4].item() == 4.0
        comm.allreduce(block, ReduceOp.Min, far)
        assert bool(cp.isnan(block[3])) and block[9].item() == 9.0
        with pytest.raises(ValueError, match="counts"):
            comm.reducescatter(block, [9], ReduceOp.Sum, far)
        send = cp.arange(16, dtype=cp.uint8)
        gathered = cp.zeros(16, dtype=cp.uint8)
        comm.allgatherv(send, gathered, [16], far)
        assert gathered.tolist() == list(range(16))
        got = cp.zeros(16, dtype=cp.uint8)
        comm.broadcast(got, 0, far, src=send)
        assert got.tolist() == list(range(16))
        swapped = cp.zeros(16, dtype=cp.uint8)
        comm.alltoallv(send, [16], swapped, [16], far)
        assert swapped.tolist() == list(range(16))
        # more than 2**31 bytes, an odd count: pieces whose counts fit a C int (CuPy before
        # 13.4 declares ncclBroadcast's count int)
        huge = cp.zeros(2 ** 31 + 3, dtype=cp.uint8)
        huge[-3:] = cp.array([7, 8, 9], dtype=cp.uint8)
        into = cp.zeros_like(huge)
        comm.broadcast(into, 0, far, src=huge)
        assert into[-3:].tolist() == [7, 8, 9] and int(into[:16].sum()) == 0
        del huge, into
        spin = cp.RawKernel(r"""
        extern "C" __global__ void spin(long long cycles) {
            long long start = clock64();
            while (clock64() - start < cycles) { }
        }""", "spin")
        stream = cp.cuda.get_current_stream()
        spin((1,), (1,), (cp.int64(1_000_000_000),))
        start = time.monotonic()
        with pytest.raises(nccl.NcclError, match="deadline.*aborted"):
            comm.wait(stream, time.monotonic() + 0.3, "test")
        assert time.monotonic() - start < 10
        with pytest.raises(nccl.NcclError, match="deadline"):
            comm.allreduce(out, ReduceOp.Sum, far)   # broken for good
        stream.synchronize()
    comm.close()


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_collective_fails_the_others_by_name():
    start = time.monotonic()
    # rank 1 dies entering the round of its 64 MiB allreduce on the device (its second)
    r = ddlrun(2, sys.executable, CHECKS, "killed", timeout=100, env={
        "DDL_TEST_FAULT": "rank=1;point=device.round;after=1;action=sigkill"})
    took = time.monotonic() - start
    lost = re.findall(r"PEER LOST after ([\d.]+)s", r.stdout)
    assert r.returncode != 0 and lost, r.stdout[-4000:] + r.stderr[-4000:]
    assert all(float(t) < 5 for t in lost), lost
    assert took < 60, took
    assert not re.search(r"<stdout>:rank \d+: ", r.stdout), r.stdout[-4000:]


@pytest.mark.timeout(600)
def test_benchmark_and_training_example_on_cuda():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("ddl-bench --device cuda makes CuPy arrays: CuPy is not installed here")
    r = ddlrun(2, "ddl-bench", "--device", "cuda", "--op", "all", "--sizes", "4,64K,16M",
               "--compare", "gloo", "--iters", "5", "--warmup", "2")
    assert r.returncode == 0 and "every result correct" in r.stdout, \
        r.stdout[-4000:] + r.stderr[-4000:]
    import torch
    gpus = torch.cuda.device_count()
    # NCCL beside ddl where each rank has a GPU; two ranks on one GPU are refused first
    r = ddlrun(2, "ddl-bench", "--device", "cuda", "--op", "all", "--sizes", "4,16M",
               "--compare", "nccl", "--iters", "5", "--warmup", "2")
    if gpus >= 2:
        assert r.returncode == 0 and "every result correct" in r.stdout \
            and "NCCL" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]
    else:
        assert r.returncode == 2 and "ranks 0 and 1 are on the same GPU" in r.stderr, \
            r.stdout[-4000:] + r.stderr[-4000:]
    r = ddlrun(2, sys.executable, os.path.join(ROOT, "examples",
                                               "pytorch_synthetic_benchmark.py"),
               "--device", "cuda", "--compare", "ddp", "--num-warmup-batches", "2",
               "--num-batches-per-iter", "2", "--num-iters", "2", "--rounds", "1")
    assert r.returncode == 0 and "on cuda" in r.stdout and "ddl / ddp:" in r.stdout, \
        r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.timeout(300)
def test_the_collective_contract_on_cupy_arrays_over_cuda_ipc():
    """tests/test_contract.py's device world on this GPU with the real CuPy (CI runs it on
    the CuPy stand-in): every collective, reduce op, dtype and odd size, a process set,
    mismatches, asynchronous and cached forms, joined ranks; 3 ranks sharing the GPU.
    Last in the file: the longest test (CuPy compiles a kernel per dtype and op)."""
    pytest.importorskip("cupy", reason="the device contract runs on CuPy arrays")
    import test_contract
    test_contract.run_contract(test_contract._device_world(
        "gpu_cuda_ipc", 3, "ipc:cuda_ipc", subset=(0, 2), standin=False))
