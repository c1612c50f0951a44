"""Checks of ddl.torch, run inside every rank of a world (see the tcp world of
test_contract.py; check_process_sets_every_rank runs in its 3-rank shm world).

Each returns a list of failure strings (empty: all good).
"""

from __future__ import annotations

import hashlib
import time
import warnings

import numpy as np
import torch

import ddl.torch as hvd


def _fail(out, cond, what):
    if not cond:
        out.append(f"rank {hvd.rank()}: {what}")


def check_collectives() -> list:
    """Every dtype, non-contiguous inputs, in-place and async forms, results' dtype."""
    out = []
    r, n = hvd.rank(), hvd.size()
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
              torch.int64, torch.int16, torch.int8, torch.uint8, torch.uint16]
    for dt in dtypes:
        x = (torch.arange(12).reshape(3, 4) % 5 + r).to(dt)
        got = hvd.allreduce(x, name=f"ar/{dt}", op=hvd.Sum)
        want = (n * (torch.arange(12).reshape(3, 4) % 5) + n * (n - 1) // 2).to(dt)
        _fail(out, got.dtype == dt and got.shape == x.shape and torch.equal(got, want),
              f"allreduce {dt}: {got}")
        _fail(out, torch.equal(x, (torch.arange(12).reshape(3, 4) % 5 + r).to(dt)),
              f"allreduce {dt} changed its input")
    b = torch.tensor([r % 2 == 0, True, False])
    _fail(out, torch.equal(hvd.allreduce(b, name="ar/bool", op=hvd.Min),
                           torch.tensor([False, True, False]) if n > 1 else b), "bool Min")
    # a non-contiguous input (a transposed view), and Average
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r
    got = hvd.allreduce(base.t(), name="ar/t")
    _fail(out, torch.allclose(got, (torch.arange(6.).reshape(2, 3) + 5 * (n - 1)).t()),
          f"non-contiguous average: {got}")
    # in place, sync and async
    t = torch.full((5,), float(r))
    same = hvd.allreduce_(t, name="ar/inplace", op=hvd.Sum)
    _fail(out, same is t and torch.equal(t, torch.full((5,), float(n * (n - 1) // 2))),
          f"allreduce_: {t}")
    t = torch.full((2, 2), float(r + 1))
    h = hvd.allreduce_async_(t, name="ar/async_", op=hvd.Max)
    _fail(out, hvd.synchronize(h) is t and torch.equal(t, torch.full((2, 2), float(n))),
          f"allreduce_async_: {t}")
    h = hvd.allreduce_async(torch.ones(3), name="ar/async", op=hvd.Sum,
                            compression=hvd.Compression.fp16)
    got = hvd.synchronize(h)
    _fail(out, got.dtype == torch.float32 and torch.equal(got, torch.full((3,), float(n))),
          f"async fp16-compressed allreduce: {got}")
    bt = torch.full((3,), float(r))
    _fail(out, torch.equal(hvd.broadcast_(bt, root_rank=n - 1, name="bc/inplace"),
                           torch.full((3,), float(n - 1))), "broadcast_")
    bt = torch.full((3,), float(r), dtype=torch.bfloat16)
    h = hvd.broadcast_async_(bt, root_rank=0, name="bc/async_")
    hvd.synchronize(h)
    _fail(out, torch.equal(bt, torch.zeros(3, dtype=torch.bfloat16)), "broadcast_async_")
    # allgather with rows per rank, alltoall with splits, reducescatter, grouped
    g = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64), name="ag")
    _fail(out, torch.equal(g, torch.cat([torch.full((k + 1, 2), k) for k in range(n)])),
          f"allgather: {g}")
    x = torch.cat([torch.full((j + 1,), 10 * r + j) for j in range(n)]).float()
    recv, splits = hvd.alltoall(x, splits=torch.tensor([j + 1 for j in range(n)]),
                                name="a2a")
    _fail(out, torch.equal(splits, torch.full((n,), r + 1, dtype=torch.int64)) and
          torch.equal(recv, torch.cat([torch.full((r + 1,), 10. * k + r) for k in range(n)])),
          f"alltoall: {recv} {splits}")
    rs = hvd.reducescatter(torch.ones(2 * n, 3), name="rs", op=hvd.Sum)
    _fail(out, torch.equal(rs, torch.full((2, 3), float(n))), f"reducescatter: {rs}")
    rs = hvd.reducescatter(torch.ones(n, 2), "rs_fp16", hvd.Compression.fp16, hvd.Sum)
    grs = hvd.grouped_reducescatter([torch.ones(n, 2)], name="g_rs_fp16",
                                    compression=hvd.Compression.bf16)
    _fail(out, rs.dtype == torch.float32 and torch.equal(rs, torch.full((1, 2), float(n)))
          and grs[0].dtype == torch.float32 and torch.equal(grs[0], torch.ones(1, 2)),
          f"compressed reducescatter: {rs} {grs}")
    a, c = hvd.grouped_allreduce([torch.ones(2), torch.ones(3, dtype=torch.float64)],
                                 name="grouped", op=hvd.Sum)
    _fail(out, torch.equal(a, torch.full((2,), float(n))) and c.dtype == torch.float64,
          "grouped_allreduce")
    ga, gr = hvd.grouped_allgather([torch.full((r + 1,), float(r))], name="g_ag"), \
        hvd.grouped_reducescatter([torch.ones(2 * n, 3)], name="g_rs", op=hvd.Sum)
    _fail(out, torch.equal(ga[0], torch.cat([torch.full((k + 1,), float(k)) for k in range(n)]))
          and torch.equal(gr[0], torch.full((2, 3), float(n))), f"grouped ag/rs {ga} {gr}")
    # the other asynchronous forms
    gs = hvd.synchronize(hvd.grouped_allreduce_async([torch.ones(2), torch.ones(1)],
                                                     name="grouped_async", op=hvd.Sum))
    recv, _ = hvd.synchronize(hvd.alltoall_async(torch.arange(n, dtype=torch.int32) + 10 * r,
                                                 name="a2a_async"))
    rs = hvd.synchronize(hvd.reducescatter_async(torch.ones(n, 2), name="rs_async",
                                                 op=hvd.Sum))
    _fail(out, torch.equal(gs[1], torch.full((1,), float(n))) and
          torch.equal(recv, torch.tensor([10 * k + r for k in range(n)], dtype=torch.int32))
          and torch.equal(rs, torch.full((1, 2), float(n))), "async grouped/alltoall/rs")
    # grouped in place, grouped async, sparse
    ts = [torch.full((2,), float(r)), torch.full((1, 3), float(r), dtype=torch.float64)]
    back = hvd.grouped_allreduce_(ts, name="grouped_", op=hvd.Sum)
    tri = float(n * (n - 1) // 2)
    _fail(out, back[0] is ts[0] and back[1] is ts[1] and torch.equal(ts[0], torch.full(
        (2,), tri)) and torch.equal(ts[1], torch.full((1, 3), tri, dtype=torch.float64)),
          f"grouped_allreduce_: {back}")
    ts = [torch.full((3,), float(r + 1))]
    h = hvd.grouped_allreduce_async_(ts, name="grouped_async_", op=hvd.Max)
    _fail(out, hvd.synchronize(h)[0] is ts[0] and torch.equal(ts[0], torch.full((3,), float(n))),
          f"grouped_allreduce_async_: {ts}")
    ga = hvd.synchronize(hvd.grouped_allgather_async(
        [torch.full((r + 1,), r, dtype=torch.int32), torch.ones(1, 2)], name="g_ag_async"))
    gr = hvd.synchronize(hvd.grouped_reducescatter_async([torch.ones(n, 2)],
                                                         name="g_rs_async"))
    _fail(out, torch.equal(ga[0], torch.cat([torch.full((k + 1,), k, dtype=torch.int32)
                                             for k in range(n)])) and ga[1].shape == (n, 2)
          and torch.equal(gr[0], torch.ones(1, 2)), f"grouped async ag/rs: {ga} {gr}")
    # a sparse tensor whose nonzeros differ per rank: rank r holds row r (value r + 1)
    # and row 0 (value 1); the Average adds them and divides by n
    sp = torch.sparse_coo_tensor(torch.tensor([[0, r], [1, 1]]),
                                 torch.tensor([1.0, r + 1.0]), (n, 2))
    h = hvd.sparse_allreduce_async(sp, name="sparse")
    got = hvd.synchronize(h)
    want = torch.zeros(n, 2)
    want[0, 1] = n
    for k in range(n):
        want[k, 1] += k + 1
    _fail(out, got.is_sparse and torch.allclose(got.to_dense(), want / n),
          f"sparse_allreduce_async: {got}")
    _fail(out, hvd.poll(h), "a finished sparse handle does not poll True")
    # Horovod's sparse handle is a function: handle() waits and returns the result
    try:
        called = hvd.sparse_allreduce_async(sp, name="sparse/call")()
        _fail(out, called.is_sparse and torch.allclose(called.to_dense(), want / n),
              f"sparse handle(): {called}")
    except TypeError as exc:
        out.append(f"rank {r}: calling a sparse_allreduce_async handle: {exc}")
    # dense shapes that differ: the same MismatchError on every rank (it was a silently
    # broken tensor), and the job goes on
    try:
        hvd.synchronize(hvd.sparse_allreduce_async(torch.ones(3 + r).to_sparse(),
                                                   name="sparse/shapes", op=hvd.Sum))
        out.append(f"rank {r}: sparse tensors of different shapes did not raise")
    except hvd.MismatchError as exc:
        _fail(out, "allreduce 'sparse/shapes': sparse tensor shape mismatch: rank 0 sent "
                   "[3], rank 1 sent [4]" in str(exc), f"sparse shape mismatch: {exc}")
    try:
        hvd.sparse_allreduce_async(torch.ones(2), name="dense")
        out.append(f"rank {r}: sparse_allreduce_async took a dense tensor")
    except ValueError as exc:
        _fail(out, "takes a sparse COO tensor" in str(exc), f"dense error: {exc}")
    kw = hvd.allreduce(tensor=torch.ones(2), name="kw/tensor", op=hvd.Sum)
    _fail(out, torch.equal(kw, torch.full((2,), float(n))), f"tensor= by keyword: {kw}")
    gen = hvd.grouped_allreduce((torch.ones(k + 1) for k in range(2)), name="kw/gen",
                                op=hvd.Sum)
    _fail(out, [g.shape[0] for g in gen] == [1, 2] and torch.equal(gen[1], torch.full(
        (2,), float(n))), f"grouped_allreduce of a generator: {gen}")
    for call, message in (
            (lambda: hvd.allreduce(np.ones(2), name="np"), "ddl.torch.allreduce takes a "
             "torch.Tensor, not ndarray; convert it (torch.as_tensor), or call ddl.allreduce"),
            (lambda: hvd.grouped_allgather(torch.ones(2)), "takes a list of torch.Tensors"),
            (lambda: hvd.sparse_allreduce_async([1]), "takes a torch.Tensor, not list; "
             "convert it (torch.as_tensor)")):
        try:
            call()
            out.append(f"rank {r}: no TypeError for {message!r}")
        except TypeError as exc:
            _fail(out, message in str(exc), f"TypeError: {exc}")
    # ... and when one rank alone passes something else, the others' call fails at once
    # too, naming it (not after the stall timeout)
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    for call, bad, message in (
            (lambda x: hvd.allreduce(x, name="one/np"), np.ones(2),
             "allreduce 'one/np': rank 1 passed ndarray to ddl.torch.allreduce, which takes "
             "a torch.Tensor"),
            (lambda x: hvd.grouped_allreduce(x), torch.ones(2),
             "rank 1 passed Tensor to ddl.torch.grouped_allreduce, which takes a list of "
             "torch.Tensors"),
            (lambda x: hvd.synchronize(hvd.sparse_allreduce_async(x, name="one/sparse")),
             [1], "allgather 'one/sparse': rank 1 passed list to "
             "ddl.torch.sparse_allreduce_async")):
        t0 = time.monotonic()
        try:
            if r == 1:
                call(bad)
            else:
                call(sparse if "sparse" in message else
                     [torch.ones(2)] if "grouped" in message else torch.ones(2))
            out.append(f"rank {r}: no error for {message!r}")
        except (TypeError, hvd.InvalidRequestError) as exc:
            _fail(out, isinstance(exc, TypeError if r == 1 else hvd.InvalidRequestError)
                  and (r == 1 or message in str(exc)) and time.monotonic() - t0 < 10,
                  f"one rank's bad input: {type(exc).__name__}: {exc}")
    _fail(out, torch.equal(hvd.allreduce(torch.ones(1), name="one/after", op=hvd.Sum),
                           torch.full((1,), float(n))), "a call after one rank's bad input")
    _fail(out, hvd.gloo_enabled() is False and hvd.mpi_enabled() is False
          and hvd.PeerLostError is __import__("ddl").PeerLostError, "neutral API")
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="complex")
        out.append(f"rank {r}: complex64 did not raise")
    except hvd.InvalidRequestError as exc:
        _fail(out, str(exc).startswith(f"allreduce 'complex': rank {r} passed a torch.Tensor "
                                       f"of dtype complex64, which ddl does not support"),
              f"complex64 error: {exc}")
    return out


def check_autograd() -> list:
    """Gradients of allreduce, allgather, broadcast, alltoall, the grouped ops and
    reducescatter against analytic ones, with Horovod's conventions (an allgather's and a
    broadcast's gradients averaged over the members; a reducescatter's the true gradient
    for Average and times the members' number for Sum)."""
    out = []
    r, n = hvd.rank(), hvd.size()
    # y = allreduce(x * (r+1), Sum); L = sum(y * w_r) with w_r = r + 2 on rank r.
    # dL_r/dy = w_r; dx_r = (r+1) * sum_j w_j
    x = torch.ones(4, requires_grad=True)
    y = hvd.allreduce(x * (r + 1), name="grad/ar", op=hvd.Sum)
    (y * (r + 2)).sum().backward()
    sum_w = sum(k + 2 for k in range(n))
    _fail(out, torch.allclose(x.grad, torch.full((4,), float((r + 1) * sum_w))),
          f"allreduce grad: {x.grad}")
    # Average with a postscale: dx_r = post * sum_j w_j / n
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, name="grad/avg", postscale_factor=3.0)
    (y * (r + 2)).sum().backward()
    _fail(out, torch.allclose(x.grad, torch.full((3,), 3.0 * sum_w / n, dtype=torch.float64)),
          f"average grad: {x.grad}")
    # allgather: rank r has r+1 rows; L_j = sum(y * (j+1)); dx_r = mean_j (j+1) * 2
    x = torch.ones(r + 1, 2, requires_grad=True)
    y = hvd.allgather(x * 2.0, name="grad/ag")
    (y * (r + 1)).sum().backward()
    total = sum(k + 1 for k in range(n))
    _fail(out, torch.allclose(x.grad, torch.full((r + 1, 2), 2.0 * total / n)),
          f"allgather grad: {x.grad}")
    # grouped allgather: the same, for each of its tensors
    xs = [torch.ones(r + 1, 2, requires_grad=True), torch.ones(2, requires_grad=True)]
    ys = hvd.grouped_allgather([xs[0] * 2.0, xs[1]], name="grad/gag")
    sum(((y * (r + 1)).sum() for y in ys)).backward()
    _fail(out, torch.allclose(xs[0].grad, torch.full((r + 1, 2), 2.0 * total / n))
          and torch.allclose(xs[1].grad, torch.full((2,), total / n)),
          f"grouped allgather grads: {[x.grad for x in xs]}")
    # broadcast from the last rank: root gets mean_j (j+1), the others zero
    x = torch.ones(3, requires_grad=True)
    y = hvd.broadcast(x, root_rank=n - 1, name="grad/bc")
    (y * (r + 1)).sum().backward()
    want = total / n if r == n - 1 else 0.0
    _fail(out, torch.allclose(x.grad, torch.full((3,), want)), f"broadcast grad: {x.grad}")
    # a finite-difference check of a composite: f(x) = sum(allreduce(x)^2) (Average)
    x = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)
    f = (hvd.allreduce(x * (r + 1), name="grad/fd") ** 2).sum()
    f.backward()
    m = sum(k + 1 for k in range(n)) / n
    # f = sum((m x)^2) on every rank: df/dx_r summed over ranks' losses = n * 2 m^2 x * (r+1)/m
    analytic = x.detach() * 2 * m * (r + 1)  # Average: d(mean)/dx_r = (r+1)/n, times n losses
    _fail(out, torch.allclose(x.grad, analytic), f"composite grad {x.grad} vs {analytic}")
    # alltoall without splits is the received tensor (Horovod's); row j of rank r goes to
    # rank j, whose loss weighs it j + 2: dx_r[j] = j + 2
    x = torch.full((n, 2), float(r + 1), requires_grad=True)
    y = hvd.alltoall(x, name="grad/a2a")
    _fail(out, isinstance(y, torch.Tensor) and torch.equal(
        y.detach(), torch.tensor([[k + 1.0] * 2 for k in range(n)])), f"alltoall: {y}")
    (y * (r + 2)).sum().backward()
    _fail(out, torch.equal(x.grad, torch.tensor([[j + 2.0] * 2 for j in range(n)])),
          f"alltoall grad: {x.grad}")
    # grouped allreduce, Average with a prescale: dx_r = pre * sum_j w_j / n per tensor
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, 1, requires_grad=True)]
    ys = hvd.grouped_allreduce(xs, name="grad/gar", prescale_factor=2.0)
    sum(((y * (r + 2)).sum() for y in ys)).backward()
    _fail(out, all(torch.allclose(x.grad, torch.full_like(x, 2.0 * sum_w / n)) for x in xs),
          f"grouped allreduce grad: {[x.grad for x in xs]}")
    # reducescatter (Sum, 2 rows per rank): block j ends on rank j, weighed j + 2 there;
    # Horovod's gradient for Sum is n times that
    x = torch.ones(2 * n, 3, requires_grad=True)
    y = hvd.reducescatter(x, name="grad/rs", op=hvd.Sum)
    (y * (r + 2)).sum().backward()
    want = torch.tensor([[n * (j // 2 + 2.0)] * 3 for j in range(2 * n)])
    _fail(out, torch.equal(x.grad, want), f"reducescatter grad: {x.grad}")
    xs = [torch.ones(n, requires_grad=True)]   # grouped, Average: the true gradient
    ys = hvd.grouped_reducescatter(xs, name="grad/grs")
    (ys[0] * (r + 2)).sum().backward()
    _fail(out, torch.allclose(xs[0].grad, torch.tensor([j + 2.0 for j in range(n)])),
          f"grouped reducescatter grad: {xs[0].grad}")
    return out


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _state_tensors(opt):
    out = []
    for state in opt.state_dict()["state"].values():
        for k in sorted(state):
            v = state[k]
            out.append(v if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
    return out


def check_state_broadcast() -> list:
    """broadcast_parameters (state_dict, named_parameters, list), broadcast_optimizer_state
    for SGD with momentum and Adam, before and after their state exists, objects."""
    out = []
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(100 + r)  # different on every rank
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    digests = hvd.allgather_object(_digest(model.state_dict().values()))
    _fail(out, len(set(digests)) == 1, f"state_dict broadcast: {digests}")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1,
                             name="bp/named")
    digests = hvd.allgather_object(_digest(model.parameters()))
    _fail(out, len(set(digests)) == 1, "named_parameters broadcast")
    plain = [torch.full((2,), float(r)), torch.full((3,), float(-r))]
    hvd.broadcast_parameters(plain, 1 % n, hvd.global_process_set, name="bp/list")
    _fail(out, torch.equal(plain[0], torch.full((2,), float(1 % n))), "list broadcast")
    try:
        hvd.broadcast_parameters(torch.ones(2), root_rank=0)
        out.append(f"rank {r}: broadcast_parameters took a bare tensor")
    except TypeError as exc:
        _fail(out, "not Tensor" in str(exc), f"broadcast_parameters(tensor): {exc}")
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1 * (r + 1), momentum=0.9),
                 lambda ps: torch.optim.Adam(ps, lr=0.01 * (r + 1))):
        opt = make(model.parameters())
        # before any state exists
        hvd.broadcast_optimizer_state(opt, root_rank=0, name=f"bos/{type(opt).__name__}/0")
        lrs = hvd.allgather_object([g["lr"] for g in opt.param_groups])
        _fail(out, all(x == lrs[0] for x in lrs), f"{type(opt).__name__} lr: {lrs}")
        # state on the root only (as if loaded from a checkpoint)
        if r == 0:
            model(torch.randn(3, 5)).sum().backward()
            opt.step()
            opt.zero_grad()
        hvd.broadcast_optimizer_state(opt, root_rank=0, name=f"bos/{type(opt).__name__}/1")
        digests = hvd.allgather_object(_digest(_state_tensors(opt)))
        _fail(out, len(set(digests)) == 1 and len(_state_tensors(opt)) > 0,
              f"{type(opt).__name__} state: {digests}")
    obj = {"epoch": 3, "rank": r, "t": torch.arange(3)}
    got = hvd.broadcast_object(obj if r == n - 1 else None, root_rank=n - 1)
    _fail(out, got["rank"] == n - 1 and torch.equal(got["t"], torch.arange(3)),
          f"broadcast_object: {got}")
    every = hvd.allgather_object(("r", r, "x" * r))
    _fail(out, every == [("r", k, "x" * k) for k in range(n)], f"allgather_object: {every}")
    return out


def check_sync_batch_norm() -> list:
    """Forward, running statistics and input gradient equal plain BatchNorm over the
    concatenation of every rank's batch (batches of different sizes)."""
    out = []
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(7)
    batches = [torch.randn(3 + k, 4, 5, 5, dtype=torch.float64) for k in range(n)]
    ref = torch.nn.BatchNorm2d(4).double()
    sync = hvd.SyncBatchNorm(4).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
        sync.weight.copy_(ref.weight)
        sync.bias.copy_(ref.bias)
    full = torch.cat(batches).requires_grad_(True)
    upstream = [torch.randn(b.shape, dtype=torch.float64) for b in batches]
    ref_y = ref(full)  # train mode: batch statistics, running statistics updated once
    (ref_y * torch.cat(upstream)).sum().backward()
    mine = batches[r].clone().requires_grad_(True)
    y = sync(mine)
    (y * upstream[r]).sum().backward()
    start = sum(b.shape[0] for b in batches[:r])
    rows = slice(start, start + mine.shape[0])
    _fail(out, torch.allclose(y, ref_y[rows], atol=1e-10), "SyncBatchNorm forward")
    _fail(out, torch.allclose(sync.running_mean, ref.running_mean, atol=1e-12) and
          torch.allclose(sync.running_var, ref.running_var, atol=1e-12),
          f"running stats {sync.running_var} vs {ref.running_var}")
    _fail(out, torch.allclose(mine.grad, full.grad[rows], atol=1e-10),
          "SyncBatchNorm input gradient")
    # eval mode: plain batch norm with the running statistics, no collective
    sync.eval()
    _fail(out, torch.allclose(sync(batches[r]), ref.eval()(batches[r]), atol=1e-12),
          "eval mode")
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)))
    _fail(out, isinstance(converted[1], hvd.SyncBatchNorm), "convert_sync_batchnorm")
    return out


def check_optimizer_misuse() -> list:
    """Clear errors, and no hang for a parameter without a gradient on one rank."""
    out = []
    r = hvd.rank()
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model[0].named_parameters()))
        out.append(f"rank {r}: missing names did not raise")
    except ValueError as exc:
        _fail(out, "does not name 2" in str(exc), f"missing names: {exc}")
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for p in model.parameters()])
        out.append(f"rank {r}: duplicate names did not raise")
    except ValueError as exc:
        _fail(out, "duplicate names: ['w']" in str(exc), f"duplicate names: {exc}")
    for passes in ("2", 1.5, True, 0):   # never compared with ints, nor truncated
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     backward_passes_per_step=passes)
            out.append(f"rank {r}: backward_passes_per_step={passes!r} did not raise")
        except ValueError as exc:
            _fail(out, f"an int >= 1, got {passes!r}" in str(exc), f"passes: {exc}")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _fail(out, isinstance(opt, torch.optim.SGD), "the wrapped optimizer is still an SGD")
    model(torch.ones(2, 3)).sum().backward()
    try:
        opt.zero_grad()
        out.append(f"rank {r}: zero_grad between backward and step did not raise")
    except hvd.DDLError as exc:
        _fail(out, "zero_grad() was called after backward()" in str(exc), f"{exc}")
    opt.step()
    opt.zero_grad()
    # rank 0 skips the second layer: its hook never fires there, the others still finish
    h = model[0](torch.ones(2, 3))
    loss = h.sum() if r == 0 else model[1](h).sum()
    loss.backward()
    opt.step()
    _fail(out, model[1].weight.grad is not None, "second layer got a (zero) gradient")
    # synchronize() then step() inside skip_synchronize: no second reduction, no warning
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    # without it: one warning, in Horovod's words (its own test looks for them)
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    _fail(out, len(caught) == 1 and "optimizer.step() called without "
          "optimizer.skip_synchronize() context after optimizer.synchronize()"
          in str(caught[0].message), f"step after synchronize: {[str(w.message) for w in caught]}")
    # the README's AMP recipe (GradScaler on the CPU), and an LR scheduler on the wrapper
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    sched.step()
    _fail(out, all(torch.allclose(p, b - 0.1 * g) for p, b, g in
                   zip(model.parameters(), before, grads)), "AMP recipe step")
    _fail(out, opt.param_groups[0]["lr"] == 0.05, f"scheduler: {opt.param_groups[0]['lr']}")
    # a second backward before step(): a clear error; step() then completes the first
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    try:
        model(torch.ones(2, 3)).sum().backward()
        out.append(f"rank {r}: a second backward before step() did not raise")
    except (hvd.DDLError, RuntimeError) as exc:
        _fail(out, "computed again before step()" in str(exc), f"second backward: {exc}")
    opt.step()
    # a new DistributedOptimizer over the same parameters (a new phase of training)
    # retires the old one: only the new one's hooks reduce, and the old one's step()
    # says why it is refused
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    old = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                   named_parameters=lin.named_parameters())
    new = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                   named_parameters=lin.named_parameters())
    for _ in range(2):
        new.zero_grad()
        (lin(torch.ones(2, 3)).sum() * (r + 1)).backward()
        new.synchronize()
        _fail(out, torch.allclose(lin.weight.grad, torch.full((1, 3), hvd.size() + 1.0)),
              f"new optimizer's averaged gradient: {lin.weight.grad}")
        with new.skip_synchronize():
            new.step()
    try:
        old.step()
        out.append(f"rank {r}: the replaced optimizer's step() did not raise")
    except hvd.DDLError as exc:
        _fail(out, "replaced by a later DistributedOptimizer" in str(exc)
              and "'weight' among them" in str(exc), f"replaced optimizer: {exc}")
    return out


def check_optimizer_features() -> list:
    """groups=, sparse gradients (gathered or densified) and bf16 compression give the
    average of every rank's gradient."""
    out = []
    r, n = hvd.rank(), hvd.size()
    for kwargs in ({"groups": 2}, {"num_groups": 3}, {"compression": hvd.Compression.bf16},
                   {"sparse_as_dense": True}, {}):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        lin = torch.nn.Linear(3, 2)
        params = list(emb.named_parameters()) + [(f"lin.{k}", v)
                                                 for k, v in lin.named_parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0),
                                       named_parameters=params, **kwargs)
        before = emb.weight.detach().clone()
        colsum = lin.weight.detach().sum(0)      # d out.sum() / d embedding row
        ids = torch.tensor([r, r + 1])           # rank r touches rows r and r+1
        lin(emb(ids)).sum().backward()
        grads = {}
        opt.synchronize()
        _fail(out, emb.weight.grad.is_sparse, f"{kwargs}: the embedding's gradient is "
              f"{emb.weight.grad.layout} after synchronize(), not sparse")
        for name, p in params:
            grads[name] = p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
        with opt.skip_synchronize():
            opt.step()
        # the embedding rows' gradient, averaged: each rank contributes lin's column sums
        want = torch.zeros(10, 3)
        for k in range(n):
            want[k] += colsum / n
            want[k + 1] += colsum / n
        tol = 2e-2 if "compression" in kwargs else 1e-6
        _fail(out, torch.allclose(grads["weight"], want, atol=tol),
              f"{kwargs}: embedding grad {grads['weight']} vs {want}")
        _fail(out, torch.allclose(emb.weight, before - want, atol=tol), f"{kwargs}: step")
    # an optimizer of sparse gradients only gets them sparse (reduced dense), as Horovod's
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters()),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=True)
    emb(torch.tensor([r])).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        out.append(f"rank {r}: SparseAdam with sparse_as_dense: {exc}")
    return out


def check_scheduler_made_before_wrapping() -> list:
    """An LR scheduler made before DistributedOptimizer wrapped the optimizer: step() is
    still the distributed one (the average of every rank's gradient), the scheduler
    still sees the optimizer's steps (no warning), and its learning rate applies."""
    out = []
    r, n = hvd.rank(), hvd.size()
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.zero_()
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    opt = hvd.DistributedOptimizer(opt, named_parameters=lin.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch warns if it did not see the step
        for _ in range(2):
            opt.zero_grad()
            lin(torch.full((1, 2), float(r + 1))).sum().backward()   # grad: r + 1
            opt.step()
            sched.step()
    mean = sum(k + 1 for k in range(n)) / n   # the averaged gradient, each step
    want = -(1.0 + 0.5) * mean                # lr 1, then 0.5
    _fail(out, torch.allclose(lin.weight, torch.full((1, 2), want)),
          f"scheduler made first: weight {lin.weight.tolist()}, want {want}")
    return out


def check_join_uneven() -> list:
    """Rank r trains on 2 + 2r batches, then joins: nobody hangs, and the last steps of
    the rank with the most batches use its own gradient alone."""
    out = []
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0, name="join/bp")
    for step in range(2 + 2 * r):
        opt.zero_grad()
        before = model.weight.detach().clone()
        model(torch.full((1, 2), float(r + 1))).sum().backward()
        opt.step()
        if r == n - 1 and step >= 2 + 2 * (n - 2):  # everyone else has joined
            _fail(out, torch.allclose(model.weight, before - 0.1 * (r + 1)),
                  f"step {step} alone: {model.weight} from {before}")
    last = hvd.join(-1)   # Horovod's torch signature: the device first
    _fail(out, last == n - 1, f"join returned {last}")
    return out


def _data(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 1, generator=g)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def check_numerical_contract() -> list:
    """2 ranks with batch b and Average give the parameters of 1 rank with batch 2b,
    after 5 steps: SGD with momentum and Adam, 1 and 2 backward passes per step, and
    fp16 compression within a looser tolerance."""
    out = []
    r, n = hvd.rank(), hvd.size()
    b = 4
    cases = [(opt_name, passes, comp) for opt_name in ("sgd", "adam") for passes in (1, 2)
             for comp in ("none",)] + [("sgd", 1, "fp16"), ("adam", 1, "fp16")]
    for opt_name, passes, comp in cases:
        def make(params):
            if opt_name == "sgd":
                return torch.optim.SGD(params, lr=0.05, momentum=0.9)
            return torch.optim.Adam(params, lr=0.01)
        ref, dist = _model(), _model()
        ref_opt = make(ref.parameters())
        opt = hvd.DistributedOptimizer(
            make(dist.parameters()), named_parameters=dist.named_parameters(),
            backward_passes_per_step=passes,
            compression=getattr(hvd.Compression, comp))
        for step in range(5):
            x, y = _data(step, n * b)
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            opt.zero_grad()
            mine_x, mine_y = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]
            per = b // passes
            for k in range(passes):  # accumulate: each pass's loss scaled by 1/passes
                sl = slice(k * per, (k + 1) * per)
                (torch.nn.functional.mse_loss(dist(mine_x[sl]), mine_y[sl]) / passes).backward()
            opt.step()
        tol = 1e-6 if comp == "none" else 2e-3
        for (name, p), q in zip(dist.named_parameters(), ref.parameters()):
            err = (p - q).abs().max().item()
            _fail(out, err <= tol, f"{opt_name} passes={passes} {comp}: {name} differs by "
                                   f"{err:.3g} (tolerance {tol})")
    return out


def check_adasum_optimizer() -> list:
    """DistributedOptimizer(op=Adasum): each rank steps on its own batch, the parameters'
    changes are Adasum-combined per tensor; the parameters are bitwise equal on every
    rank and match a one-process simulation of every rank (tests/_checks.reference_adasum)."""
    from _checks import reference_adasum
    out = []
    r, n = hvd.rank(), hvd.size()
    b = 4
    for opt_name in ("sgd", "adam"):
        def make(params):
            if opt_name == "sgd":
                return torch.optim.SGD(params, lr=0.05, momentum=0.9)
            return torch.optim.Adam(params, lr=0.01)
        dist = _model()
        opt = hvd.DistributedOptimizer(make(dist.parameters()),
                                       named_parameters=dist.named_parameters(), op=hvd.Adasum)
        sims = [_model() for _ in range(n)]  # every rank's model and optimizer state
        sim_opts = [make(m.parameters()) for m in sims]
        for step in range(4):
            x, y = _data(100 + step, n * b)
            opt.zero_grad()
            torch.nn.functional.mse_loss(dist(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]
                                         ).backward()
            opt.step()
            olds = [[p.detach().clone() for p in m.parameters()] for m in sims]
            for k, (m, o) in enumerate(zip(sims, sim_opts)):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(x[k * b:(k + 1) * b]), y[k * b:(k + 1) * b]
                                             ).backward()
                o.step()
            with torch.no_grad():
                for i, old in enumerate(olds[0]):
                    deltas = [(list(m.parameters())[i] - old).numpy() for m in sims]
                    new = old + torch.from_numpy(reference_adasum(deltas)).to(old.dtype)
                    for m in sims:
                        list(m.parameters())[i].copy_(new)
        flat = torch.cat([p.detach().reshape(-1) for p in dist.parameters()])
        rows = hvd.allgather(flat.reshape(1, -1), name=f"adasum-opt/{opt_name}")
        _fail(out, all(torch.equal(row, flat) for row in rows),
              f"adasum {opt_name}: parameters differ across ranks")
        for (name, p), q in zip(dist.named_parameters(), sims[0].parameters()):
            err = (p - q).abs().max().item()
            _fail(out, err <= 1e-6, f"adasum {opt_name}: {name} differs from the "
                                    f"reference by {err:.3g}")
        moved = max((p - q).abs().max().item()
                    for p, q in zip(dist.parameters(), _model().parameters()))
        _fail(out, moved > 1e-3, f"adasum {opt_name}: the parameters did not move ({moved})")
    return out


def check_process_sets_every_rank() -> list:
    """Horovod's way with process sets (3 ranks or more): every rank calls
    add_process_set for every set, members and not; a non-member gets a set it is not in,
    with the id the members got, which its collectives refuse, and its remove_process_set
    clears once the members removed it; a DistributedOptimizer
    over a set this rank is not in steps with this rank's gradients alone, while the
    members average theirs."""
    out = []
    r, n = hvd.rank(), hvd.size()
    pair = [0, 1]                           # the set of the first two ranks
    rest = list(range(2, n))                # and of the others
    sets = [hvd.add_process_set(pair), hvd.add_process_set(rest)]
    mine, other = sets if r in pair else sets[::-1]
    _fail(out, mine.included() and mine.rank() == mine.ranks.index(r)
          and not other.included() and other.rank() == -1 and other.size() == len(other.ranks),
          f"sets after add_process_set on every rank: {sets}")
    ids = hvd.allgather(torch.tensor([[ps.process_set_id for ps in sets]]), name="every/ids")
    _fail(out, all(i not in (None, 0) for i in ids[0].tolist())
          and (ids == ids[0]).all().item(), f"the sets' ids on every rank: {ids.tolist()}")
    got = hvd.allreduce(torch.tensor([float(r)]), name="every/sum", op=hvd.Sum,
                        process_set=mine)
    _fail(out, got.item() == sum(mine.ranks), f"allreduce on its own set: {got}")
    try:
        hvd.allreduce(torch.ones(1), name="every/other", process_set=other)
        out.append(f"rank {r}: a collective on a set it is not in did not raise")
    except ValueError as exc:
        _fail(out, f"rank {r} is not a member of" in str(exc), f"non-member call: {exc}")
    # DistributedOptimizer over the pair, made on every rank: the pair averages, the
    # others step alone (rank r's gradient is r + 1 everywhere)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0),
                                   named_parameters=[("every/w", w)], process_set=sets[0])
    (w.sum() * (r + 1)).backward()
    opt.step()
    want = -(sum(k + 1 for k in pair) / len(pair)) if r in pair else -(r + 1.0)
    _fail(out, torch.allclose(w.detach(), torch.full((3,), want)),
          f"optimizer over {pair}: w = {w.detach().tolist()}, want {want}")
    for ps in sets:
        hvd.remove_process_set(ps)          # every rank, as Horovod's scripts do
    _fail(out, mine.process_set_id is None and other.process_set_id is None,
          f"{sets} still registered after removal")
    # Horovod's static sets: init(process_sets=[...]) on every rank (joined already here,
    # as under ddl.run and the engines): the sets registered, in order; all ranks is the
    # global set; "dynamic" is accepted
    first, others = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, n))
    everyone = hvd.ProcessSet(range(n))
    hvd.init(process_sets=[first, others, everyone])
    hvd.init(process_sets="dynamic")
    own = first if r == 0 else others
    _fail(out, everyone.process_set_id == 0 and own.process_set_id not in (None, 0)
          and (others if r == 0 else first).process_set_id not in (None, 0),
          f"init(process_sets=...): {first}, {others}, {everyone}")
    got = hvd.allreduce(torch.tensor([1.0]), name="static/sum", op=hvd.Sum, process_set=own)
    _fail(out, got.item() == own.size(), f"allreduce on a static set: {got}")
    if r == 1:   # one member again alone (a persistent Ray rank's later run): no agreement
        again = hvd.ProcessSet(range(1, n))
        hvd.init(process_sets=[again])
        _fail(out, again.process_set_id == others.process_set_id, f"init again: {again}")
    for ps in (first, others):
        hvd.remove_process_set(ps)
    hvd.barrier()
    return out
