"""Checks on device arrays inside every rank of a world on a GPU machine.

Run by tests/gpu/test_gpu.py as ``ddlrun -np N python tests/gpu/_gpu_checks.py WHAT``;
each rank prints ``GPU CHECKS OK <what>`` or its failures, one per line, and exits 1.
Inputs are small integers, so every result is exact and compared bit for bit with a host
reference; every result must come back as the input's kind, on its device, in its dtype.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

import ddl
import ddl.torch as hvd

FAILURES: list = []


def fail(text: str) -> None:
    FAILURES.append(f"rank {hvd.rank()}: {text}")


def gpu() -> torch.device:
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())


def pattern(rank: int, n: int, dtype: torch.dtype, modulus: int = 13) -> torch.Tensor:
    """``(i + 7 * rank) % modulus`` at element i, on the host, in ``dtype``."""
    return ((torch.arange(n, dtype=torch.int64) + 7 * rank) % modulus).to(dtype)


def expect(tag: str, got, want: torch.Tensor, device: torch.device) -> None:
    if not isinstance(got, torch.Tensor):
        return fail(f"{tag}: got a {type(got).__name__}, not a tensor")
    if got.device != device:
        return fail(f"{tag}: result on {got.device}, input on {device}")
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return fail(f"{tag}: result {got.dtype}{list(got.shape)}, want "
                    f"{want.dtype}{list(want.shape)}")
    if not torch.equal(got.cpu(), want):
        return fail(f"{tag}: values differ from the host reference")


DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
          torch.int64, torch.uint8)


def check_collectives() -> None:
    """Every collective, dtype and size class (one element, 64 KiB, 16 MiB) on CUDA."""
    rank, n, dev = hvd.rank(), hvd.size(), gpu()
    ranks = range(n)
    for dtype in DTYPES:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        for count in (1, (64 << 10) // itemsize, (16 << 20) // itemsize):
            tag = f"{dtype}/{count}"
            mine = pattern(rank, count, dtype)
            x = mine.to(dev)
            total = sum(pattern(r, count, torch.int64) for r in ranks).to(dtype)
            expect(f"allreduce sum {tag}", hvd.allreduce(x, name=f"ar/{tag}", op=hvd.Sum),
                   total, dev)
            expect(f"allreduce max {tag}", hvd.allreduce(x, name=f"mx/{tag}", op=hvd.Max),
                   torch.stack([pattern(r, count, dtype) for r in ranks]).amax(0), dev)
            if not torch.equal(x.cpu(), mine):
                fail(f"allreduce {tag} changed its input")
            expect(f"broadcast {tag}", hvd.broadcast(x, root_rank=n - 1, name=f"bc/{tag}"),
                   pattern(n - 1, count, dtype), dev)
            expect(f"allgather {tag}", hvd.allgather(x, name=f"ag/{tag}"),
                   torch.cat([pattern(r, count, dtype) for r in ranks]), dev)
        rows = torch.arange(2 * n, dtype=torch.int64).reshape(2 * n, 1).to(dtype)
        got, _ = hvd.alltoall((rows + rank).to(dev), name=f"a2a/{dtype}")
        want = torch.cat([(rows + r)[2 * rank:2 * rank + 2] for r in ranks])
        expect(f"alltoall {dtype}", got, want, dev)
        block = torch.ones(n * 3, dtype=dtype)
        expect(f"reducescatter {dtype}",
               hvd.reducescatter(block.to(dev), name=f"rs/{dtype}", op=hvd.Sum),
               (block[:3] * n).to(dtype), dev)
    # grouped and asynchronous forms, in place too
    xs = [torch.full((k + 1,), float(rank), device=dev) for k in range(5)]
    for k, got in enumerate(hvd.grouped_allreduce(xs, name="grouped", op=hvd.Sum)):
        expect(f"grouped allreduce {k}", got, torch.full((k + 1,), float(sum(ranks))), dev)
    handle = hvd.allreduce_async(torch.ones(1000, device=dev), name="async", op=hvd.Sum)
    expect("allreduce_async", hvd.synchronize(handle), torch.full((1000,), float(n)), dev)
    y = torch.full((7,), float(rank + 1), device=dev)
    hvd.allreduce_(y, name="inplace", op=hvd.Sum)
    expect("allreduce_", y, torch.full((7,), float(sum(r + 1 for r in ranks))), dev)
    # a CUDA tensor on one rank and a host tensor on another: both named, both kinds
    z = torch.zeros(4, device=dev) if rank == 0 else torch.zeros(4)
    try:
        hvd.allreduce(z, name="kinds")
    except hvd.MismatchError as exc:
        text = str(exc)
        if ("memory mismatch" not in text or "cuda" not in text or "host" not in text
                or "rank 0" not in text):
            fail(f"memory mismatch message: {text}")
    else:
        if n > 1:
            fail("a CUDA tensor against host tensors raised nothing")
    expect("after a mismatch", hvd.allreduce(torch.ones(2, device=dev), name="after",
                                             op=hvd.Sum), torch.full((2,), float(n)), dev)
    # work still queued on a side stream: the collective reads the input after it, and
    # later work on that stream reads the result after the collective
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        a = torch.full((1 << 22,), float(rank), device=dev)
        for _ in range(30):
            a = a * 1.0 + 0.0
        got = hvd.allreduce(a, name="stream", op=hvd.Sum) * 2.0
    side.synchronize()
    expect("on a side stream", got, torch.full((1 << 22,), 2.0 * sum(ranks)), dev)
    # 0-d, non-contiguous and integer Average on the device
    expect("0-d", hvd.allreduce(torch.tensor(float(rank), device=dev), name="zerod",
                                op=hvd.Sum), torch.tensor(float(sum(ranks))), dev)
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expect("non-contiguous", hvd.allreduce(m.to(dev).t(), name="transposed", op=hvd.Sum),
           (m.t() * n).contiguous(), dev)
    ints = torch.tensor([7 * rank - 5, -3, 2 ** 40 + rank], dtype=torch.int64)
    want = sum(torch.tensor([7 * r - 5, -3, 2 ** 40 + r], dtype=torch.int64)
               for r in ranks)
    want = torch.where(want < 0, -((-want) // n), want // n)
    expect("int64 average", hvd.allreduce(ints.to(dev), name="iavg", op=hvd.Average),
           want, dev)
    try:
        import cupy  # noqa: F401  (with CuPy, CUDA tensors must never touch the host)
    except ImportError:
        pass
    else:
        from ddl import _adapters
        if _adapters._STAGED:
            fail(f"CUDA tensors were staged through host memory: {_adapters._STAGED}")


def check_cupy() -> None:
    """CuPy arrays (through the core collectives: ddl.torch's take tensors) in, CuPy
    arrays out, on the input's device, in its dtype."""
    import cupy

    rank, n = hvd.rank(), hvd.size()
    with cupy.cuda.Device(gpu().index):
        x = cupy.arange(1 << 18, dtype=cupy.float32) + rank
        got = ddl.allreduce(x, name="cupy/ar", op=ddl.Sum)
        want = sum(np.arange(1 << 18, dtype=np.float32) + r for r in range(n))
        if not isinstance(got, cupy.ndarray) or got.device.id != x.device.id:
            fail(f"cupy allreduce returned {type(got)} on {getattr(got, 'device', None)}")
        elif got.dtype != x.dtype or not np.array_equal(cupy.asnumpy(got), want):
            fail(f"cupy allreduce gave {got.dtype} values that differ")
        got = ddl.allgather(cupy.full((2, 3), rank, dtype=cupy.int32), name="cupy/ag")
        want = np.repeat(np.arange(n, dtype=np.int32), 2)[:, None].repeat(3, axis=1)
        if got.dtype != cupy.int32 or not np.array_equal(cupy.asnumpy(got), want):
            fail(f"cupy allgather gave {got.dtype} values that differ")


def check_jax() -> None:
    """JAX arrays on the GPU in, JAX arrays on the same GPU out (ddl.jax)."""
    import jax
    import jax.numpy as jnp

    import ddl.jax as hj

    rank, n = hvd.rank(), hvd.size()
    gpus = jax.devices("gpu")
    device = gpus[hvd.local_rank() % len(gpus)]
    x = jax.device_put(jnp.arange(4096, dtype=jnp.float32) + rank, device)
    got = hj.allreduce(x, name="jax/ar", op=hj.Sum)
    want = sum(np.arange(4096, dtype=np.float32) + r for r in range(n))
    if not isinstance(got, jax.Array) or got.devices() != {device}:
        fail(f"jax allreduce returned {type(got)} on {getattr(got, 'devices', lambda: None)()}")
    elif not np.array_equal(np.asarray(got), want):
        fail("jax allreduce values differ")
    # bfloat16 crosses DLPack as its uint16 bits (CuPy before 14 has no DLPack bfloat16)
    b = jax.device_put((jnp.arange(64, dtype=jnp.float32) + rank).astype(jnp.bfloat16),
                       device)
    got = hj.allreduce(b, name="jax/ar/bf16", op=hj.Max)
    want = (np.arange(64, dtype=np.float32) + n - 1).astype(got.dtype)
    if got.dtype != jnp.bfloat16 or got.devices() != {device}:
        fail(f"jax bfloat16 allreduce returned {got.dtype} on {got.devices()}")
    elif not np.array_equal(np.asarray(got), want):
        fail("jax bfloat16 allreduce values differ")


def check_training() -> None:
    """DistributedOptimizer, the broadcasts and SyncBatchNorm on a CUDA model, from
    different initial weights on every rank: every rank ends with the same weights."""
    rank, n, dev = hvd.rank(), hvd.size(), gpu()
    torch.manual_seed(1000 + rank)  # different initial weights: the broadcast must fix them
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), hvd.SyncBatchNorm(32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        data = torch.randn(8, 16, generator=gen).to(dev)
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat[None], name="train/weights")
    if every.device != dev:
        fail(f"allgather of weights came back on {every.device}")
    if not all(torch.equal(every[0], every[r]) for r in range(n)):
        fail("ranks ended with different weights")


def check_killed_rank() -> None:
    """The last rank is killed (SIGKILL, DDL_TEST_FAULT: as it enters its second round on
    the device, inside a 64 MiB CUDA allreduce); the others must raise PeerLostError
    naming it within seconds (and exit 3; ddlrun exits non-zero)."""
    rank, n, dev = hvd.rank(), hvd.size(), gpu()
    hvd.allreduce(torch.ones(4, device=dev), name="warm")
    big = torch.ones(16 << 20, device=dev)
    start = time.monotonic()
    try:
        hvd.allreduce(big, name="big")
    except hvd.PeerLostError as exc:
        took = time.monotonic() - start
        print(f"PEER LOST after {took:.2f}s: {exc}", flush=True)
        if f"rank {n - 1}" not in str(exc) or took > 5:
            fail(f"PeerLostError after {took:.2f}s: {exc}")
        report_and_exit(3)
    fail("no PeerLostError")


def check_slot_mismatch() -> None:
    """Rank 0 runs with DDL_CUDA_IPC_SLOT_MB=64, the others with 128 (set by main before
    init): the first device collective must fail on every rank before any rank touches
    another's slots, with a MismatchError naming both sizes (or, on a rank that the
    group's failure reached first, a PeerLostError carrying that message); then exit 3."""
    try:
        hvd.allreduce(torch.ones(4, device=gpu()), name="slots")
    except (hvd.MismatchError, hvd.PeerLostError) as exc:
        print(f"SLOT MISMATCH: {type(exc).__name__}: {exc}", flush=True)
        if str(64 << 20) not in str(exc) or str(128 << 20) not in str(exc):
            fail(f"{type(exc).__name__} without both slot sizes: {exc}")
        report_and_exit(3)
    fail("no error for different DDL_CUDA_IPC_SLOT_MB")


CHECKS = {"collectives": check_collectives, "cupy": check_cupy, "jax": check_jax,
          "training": check_training, "killed": check_killed_rank,
          "slots": check_slot_mismatch}


def report_and_exit(code: int) -> None:
    """Print the failures (then exit 1), or exit with ``code``."""
    if FAILURES:
        print("\n".join(FAILURES), flush=True)
        sys.exit(1)
    sys.exit(code)


def main() -> None:
    what = sys.argv[1:]
    if "slots" in what:
        os.environ["DDL_CUDA_IPC_SLOT_MB"] = "64" if os.environ["DDL_RANK"] == "0" else "128"
    hvd.init()
    for name in what:
        CHECKS[name]()
    hvd.barrier()
    if FAILURES:
        report_and_exit(1)
    print(f"GPU CHECKS OK {' '.join(what)}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
