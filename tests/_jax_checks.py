"""Checks of ddl.jax, run in every rank of one 2-rank world in the JAX environment:
``ddlrun -np 2 python tests/_jax_checks.py TIMELINE_DIR`` prints ``JAX CHECKS OK`` on
rank 0, or every failure (and exits 1).

What runs: the collective contract of tests/_contract_checks.py over ``jax.Array``; every
collective inside ``jax.jit`` (every reduce op with scale factors, pytrees, ``lax.scan``,
``value_and_grad``); one collective per jitted training step (read from the Timeline);
the gradients of every collective against global finite differences; the numerical
contract (2 ranks with batch b and Average match 1 rank with batch 2b after 5 optax-adam
steps, inside ``jax.jit``, to 1e-6); compression; broadcasts of pytrees, optax state and
flax ``nnx`` objects; and the errors (a traced value where a concrete one is needed, the
core API given a tracer, ``vmap``, a mismatch across ranks eagerly and inside ``jit``).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ddl
import ddl.jax as hvd

fails = []


def check(cond, what):
    if not cond:
        fails.append(f"rank {hvd.rank()}: {what}")


def raises(fn, exc, *needles):
    """Whether ``fn()`` raises ``exc`` with every needle in its message (else a failure)."""
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        return not missing or fails.append(f"rank {hvd.rank()}: {exc.__name__} without "
                                            f"{missing}: {e}")
    except Exception as e:  # noqa: BLE001
        fails.append(f"rank {hvd.rank()}: expected {exc.__name__} {needles}, got "
                     f"{type(e).__name__}: {str(e)[:400]}")
        return False
    fails.append(f"rank {hvd.rank()}: expected {exc.__name__} {needles}, nothing raised")
    return False


def every(r):
    """Every rank's input in a check seeded by ``r`` (each rank rebuilds all of them)."""
    return [np.random.default_rng(100 + 7 * k + r).standard_normal((4, 3)).astype(np.float32)
            for k in range(hvd.size())]


# -- 1. inside jax.jit ----------------------------------------------------------------------

def jitted_collectives():
    r, n = hvd.rank(), hvd.size()
    xs = every(1)
    x = jnp.asarray(xs[r])
    total = sum(xs)
    for op, want in ((hvd.Sum, total), (hvd.Average, total / n),
                     (hvd.Min, np.minimum.reduce(xs)), (hvd.Max, np.maximum.reduce(xs)),
                     (hvd.Product, np.multiply.reduce(xs))):
        f = jax.jit(lambda v, op=op: hvd.allreduce(v, name=f"jit/{op.name}", op=op,
                                                   prescale_factor=2.0, postscale_factor=0.5))
        for _ in range(2):  # the second call runs the compiled step again
            got = f(x)
            scaled = {"Product": want * 2.0 ** n * 0.5, "Min": want, "Max": want}.get(
                op.name, want)
            check(isinstance(got, jax.Array) and got.dtype == jnp.float32 and
                  np.allclose(np.asarray(got), scaled, rtol=1e-5, atol=1e-5),
                  f"jit allreduce {op.name}: {np.asarray(got)} vs {scaled}")
    # Adasum, eagerly and inside jit, against the tree formula (tests/_checks.py)
    from _checks import reference_adasum
    want = reference_adasum(xs)
    f = jax.jit(lambda v: hvd.allreduce(v, name="jit/Adasum", op=hvd.Adasum))
    for got in (f(x), f(x), hvd.allreduce(x, name="eager/Adasum", op=hvd.Adasum)):
        check(isinstance(got, jax.Array) and got.dtype == jnp.float32 and
              np.allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6),
              f"allreduce Adasum: {np.asarray(got)} vs {want}")
    tree = {"w": x, "b": [jnp.ones(2) * r, jnp.arange(3, dtype=jnp.int32)]}
    got = jax.jit(lambda t: hvd.allreduce(t, name="jit/tree", op=hvd.Sum))(tree)
    check(np.allclose(got["w"], total, atol=1e-5) and np.allclose(got["b"][0], n * (n - 1) / 2)
          and got["b"][1].dtype == jnp.int32 and np.array_equal(got["b"][1], n * np.arange(3)),
          f"jit pytree allreduce {got}")
    g = jax.jit(lambda v: hvd.allgather(v, name="jit/gather"))(x)
    check(np.array_equal(np.asarray(g), np.concatenate(xs)), "jit allgather")
    b = jax.jit(lambda t: hvd.broadcast(t, root_rank=n - 1, name="jit/bcast"))(tree)
    check(np.array_equal(np.asarray(b["w"]), xs[n - 1]) and
          np.array_equal(np.asarray(b["b"][0]), np.ones(2) * (n - 1)), "jit broadcast pytree")
    rs = jax.jit(lambda v: hvd.reducescatter(v, name="jit/rs", op=hvd.Sum))(x)
    check(np.allclose(np.asarray(rs), total[r * 4 // n:(r + 1) * 4 // n], atol=1e-5),
          "jit reducescatter")
    a2a, splits = jax.jit(lambda v: hvd.alltoall(v, name="jit/a2a"))(x)
    want = np.concatenate([xs[k][r * 4 // n:(r + 1) * 4 // n] for k in range(n)])
    check(np.array_equal(np.asarray(a2a), want) and list(np.asarray(splits)) == [4 // n] * n,
          "jit alltoall")
    # grouped allgather and reducescatter: jitted, eager, and differentiated
    ga = jax.jit(lambda a, b: hvd.grouped_allgather([a, b], name="jit/g_gather"))(x, x[:2])
    grs = hvd.grouped_reducescatter([x, 2 * x], name="eager/g_rs", op=hvd.Sum)
    block = slice(r * 4 // n, (r + 1) * 4 // n)
    dg = jax.grad(lambda a: jnp.sum(hvd.grouped_allgather([a, 3 * a], name="grad/g_gather")[1]))(x)
    check(np.array_equal(np.asarray(ga[0]), np.concatenate(xs)) and np.array_equal(
        np.asarray(ga[1]), np.concatenate([v[:2] for v in xs])) and
        np.allclose(np.asarray(grs[0]), total[block], atol=1e-5) and
        np.allclose(np.asarray(grs[1]), 2 * total[block], atol=1e-5) and
        np.allclose(np.asarray(dg), 3 * n), f"grouped allgather/reducescatter {ga} {grs} {dg}")
    # lax.scan: the collective runs once per iteration, in order
    def body(c, i):
        s = hvd.allreduce(c + i, name="scan", op=hvd.Sum)
        return s / n, s[0]
    final, firsts = jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(3.0)))(x)
    c, want_firsts = sum(xs) / n, []
    c = np.mean(xs, axis=0)
    cs = [xs[k] for k in range(n)]
    for i in range(3):
        s = sum(v + i for v in cs)
        want_firsts.append(s[0])
        cs = [s / n] * n
    check(np.allclose(np.asarray(final), cs[0], atol=1e-5) and
          np.allclose(np.asarray(firsts), np.stack(want_firsts), atol=1e-5), "lax.scan")
    # value_and_grad through a jitted step
    val, grad = jax.jit(jax.value_and_grad(
        lambda v: jnp.sum(hvd.allreduce(v, name="vag", op=hvd.Sum) ** 2)))(x)
    check(np.allclose(val, np.sum(total ** 2), rtol=1e-5) and
          np.allclose(grad, n * 2 * total, rtol=1e-5), "value_and_grad")
    # eager: results on the input's device, inputs unchanged, uneven allgather
    e = hvd.allgather(jnp.full((r + 1, 2), r, jnp.float32), name="uneven")
    check(e.shape == (n * (n + 1) // 2, 2) and e.devices() == x.devices(), "eager uneven")
    check(np.array_equal(np.asarray(x), xs[r]), "input unchanged")


# -- 2. one collective per jitted training step -----------------------------------------------

def one_collective_per_step(timeline_dir):
    r = hvd.rank()
    params = {"w1": jnp.ones((8, 16)), "b1": jnp.zeros(16), "w2": jnp.ones((16, 1)),
              "b2": jnp.zeros(1)}
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), name="steps")
    state = tx.init(params)

    @jax.jit
    def step(p, s, x):
        grads = jax.grad(lambda q: jnp.mean((jnp.tanh(x @ q["w1"] + q["b1"]) @ q["w2"]
                                             + q["b2"]) ** 2))(p)
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s

    x = jnp.ones((4, 8)) * (r + 1)
    params, state = step(params, state, x)  # compiles
    hvd.start_timeline(os.path.join(timeline_dir, "tl-{rank}.json"))
    path = os.path.join(timeline_dir, f"tl-{r}.json")
    for _ in range(3):
        params, state = step(params, state, x)
    jax.block_until_ready(params)
    hvd.stop_timeline()
    with open(path) as f:
        events = json.load(f)
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    ran = [rows.get(e["tid"]) for e in events
           if e.get("name") == "ALLREDUCE" and e.get("ph") == "B"]
    # (a group of the flat buffer and the tree's zero-size mark, see structure_mark)
    check(ran == ["steps/0", "steps/1"] * 3,
          f"3 jitted steps ran {ran} (want one fused allreduce each)")


# -- 3. gradients against global finite differences ---------------------------------------------

def gradients():
    """For each collective f: the VJP on every rank is the gradient of the global objective
    G = sum over ranks of <ct_r, f_r(x)>, checked against central differences of G along
    random directions (each rank perturbs its own input)."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(7 + r)
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    cases = {
        "allreduce-sum": lambda v: hvd.allreduce(v, op=hvd.Sum, name="fd"),
        "allreduce-avg": lambda v: hvd.allreduce(v, op=hvd.Average, name="fd",
                                                 prescale_factor=3.0, postscale_factor=0.5),
        "allgather": lambda v: hvd.allgather(v, name="fd"),
        "broadcast": lambda v: hvd.broadcast(v, root_rank=1, name="fd"),
        "reducescatter": lambda v: hvd.reducescatter(v, op=hvd.Average, name="fd"),
        "alltoall": lambda v: hvd.alltoall(v, name="fd")[0],
    }
    for label, f in cases.items():
        y, vjp = jax.vjp(f, x)
        ct = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
        (g,) = vjp(ct)
        for _ in range(2):
            v = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
            eps = 1e-2
            local = lambda z: jnp.vdot(ct, f(z))  # noqa: E731
            diff = hvd.allreduce(local(x + eps * v) - local(x - eps * v), op=hvd.Sum,
                                 name="fd/G") / (2 * eps)
            want = hvd.allreduce(jnp.vdot(g, v), op=hvd.Sum, name="fd/Gv")
            check(abs(float(diff) - float(want)) <= 1e-3 * (1 + abs(float(want))),
                  f"gradient of {label}: finite differences {float(diff)} vs VJP {float(want)}")
    # the closed forms, exactly
    ct = jnp.full((4, 3), r + 1.0)
    (g,) = jax.vjp(lambda v: hvd.broadcast(v, 0, name="cf"), x)[1](ct)
    check(np.allclose(g, n * (n + 1) / 2 if r == 0 else 0.0), f"broadcast grad {g}")
    (g,) = jax.vjp(lambda v: hvd.allreduce(v, name="cf"), x)[1](ct)
    check(np.allclose(g, (n + 1) / 2), f"average allreduce grad {g}")
    raises(lambda: jax.grad(lambda v: jnp.sum(hvd.allreduce(v, op=hvd.Max, name="mx")))(x),
           TypeError, "Max", "only Sum and Average")


# -- 4. the numerical contract --------------------------------------------------------------

def numerical_contract():
    """2 ranks with batch b and Average == 1 rank with batch 2b, after 5 adam steps, jitted."""
    r, n, b = hvd.rank(), hvd.size(), 16
    rng = np.random.default_rng(0)  # the same on every rank
    data = rng.standard_normal((5, n * b, 10)).astype(np.float32)
    labels = rng.standard_normal((5, n * b, 1)).astype(np.float32)
    init = {"w1": rng.standard_normal((10, 32)).astype(np.float32) * 0.3,
            "b1": np.zeros(32, np.float32),
            "w2": rng.standard_normal((32, 1)).astype(np.float32) * 0.3,
            "b2": np.zeros(1, np.float32)}

    def loss(p, x, y):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    def train(tx, shard):
        p = jax.tree_util.tree_map(jnp.asarray, init)
        s = tx.init(p)

        @jax.jit
        def step(p, s, x, y):
            u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
            return optax.apply_updates(p, u), s

        for i in range(5):
            p, s = step(p, s, data[i][shard], labels[i][shard])
        return p

    mine = train(hvd.DistributedOptimizer(optax.adam(1e-2), name="contract"),
                 slice(r * b, (r + 1) * b))
    alone = train(optax.adam(1e-2), slice(0, n * b))
    err = max(float(jnp.max(jnp.abs(mine[k] - alone[k]))) for k in init)
    check(err <= 1e-6, f"numerical contract: 2x{b} vs 1x{n * b} differ by {err:.3g}")
    moved = max(float(jnp.max(jnp.abs(mine[k] - init[k]))) for k in init)
    check(moved > 1e-3, f"the parameters did not train ({moved})")


def compression():
    r, n = hvd.rank(), hvd.size()
    tree = {"a": jnp.full((300,), r + 0.5, jnp.float32), "i": jnp.full((2,), r, jnp.int32)}
    for comp, dt in ((hvd.Compression.bf16, jnp.bfloat16), (hvd.Compression.fp16, jnp.float16)):
        out = jax.jit(lambda t: hvd.fused_allreduce(t, name=f"comp/{comp.name}",
                                                    compression=comp))(tree)
        check(out["a"].dtype == jnp.float32 and out["i"].dtype == jnp.int32 and
              np.allclose(out["a"], sum(k + 0.5 for k in range(n)) / n, rtol=1e-2) and
              np.array_equal(out["i"], np.full(2, (n - 1) // 2)), f"{comp} {out}")
        got = hvd.allreduce(jnp.full((3,), 1.0 + r, jnp.float32), name=f"c/{comp.name}",
                            compression=comp)
        check(got.dtype == jnp.float32 and np.allclose(got, 1.0 + (n - 1) / 2, rtol=1e-2),
              f"allreduce with {comp}: {got}")
        del dt


# -- 5. broadcasts of state -------------------------------------------------------------------

def broadcasts():
    from flax import nnx
    r = hvd.rank()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    model = Net(nnx.Rngs(r))  # different on each rank
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jnp.ones((2, 3)) * (r + 1)
    grads = nnx.grad(lambda m: jnp.sum(m.bn(m.lin(x)) ** 2))(model)
    opt.update(model, grads)
    same = hvd.broadcast_parameters(opt, root_rank=0)
    check(same is opt, "an nnx object is updated in place and returned")
    leaves = jax.tree_util.tree_leaves(nnx.state(opt))
    everyone = hvd.allgather_object([np.asarray(v) for v in leaves])
    check(all(np.array_equal(a, b) for a, b in zip(everyone[0], everyone[-1])),
          "nnx Optimizer (model and adam state) equal after broadcast")
    state = {"count": jnp.asarray(r, jnp.int32), "lr": 0.1 * (r + 1), "flag": r == 0,
             "mu": [jnp.ones(3) * r], "name": f"rank{r}", "u": jnp.asarray([2**31 + r], jnp.uint32),
             "key": jax.random.key(r), "raw": jax.random.PRNGKey(r), "n": np.uint64(r)}
    got = hvd.broadcast_state(state, root_rank=1)
    check(int(got["count"]) == 1 and got["lr"] == 0.2 and type(got["lr"]) is float and
          got["flag"] is False and np.array_equal(got["mu"][0], np.ones(3)) and
          got["name"] == f"rank{r}" and got["u"].dtype == jnp.uint32 and
          int(got["u"][0]) == 2**31 + 1 and got["n"].dtype == np.uint64 and int(got["n"]) == 1
          and np.array_equal(jax.random.key_data(got["key"]),
                             jax.random.key_data(jax.random.key(1)))
          and np.array_equal(got["raw"], jax.random.PRNGKey(1)), f"broadcast_state {got}")
    opt_state = optax.adam(1e-3).init({"w": jnp.ones(2) * r})
    got = hvd.broadcast_state(opt_state, root_rank=0, name="adam")
    check(type(got) is type(opt_state) and
          all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
              jax.tree_util.tree_leaves(got),
              jax.tree_util.tree_leaves(optax.adam(1e-3).init({"w": jnp.ones(2) * 0})))),
          "optax state broadcast")


# -- 6. errors ---------------------------------------------------------------------------------

def errors():
    r, n = hvd.rank(), hvd.size()
    x = jnp.ones(3)
    raises(lambda: jax.jit(lambda v, root: hvd.broadcast(v, root, name="e1"))(x, 0),
           TypeError, "root_rank", "traced", "static_argnums")
    raises(lambda: jax.jit(lambda v, s: hvd.allreduce(v, name="e2", prescale_factor=s))(x, 2.),
           TypeError, "prescale_factor", "traced")
    raises(lambda: jax.jit(lambda v: ddl.allreduce(v, name="core"))(x),
           hvd.InvalidRequestError, "traced JAX value", "ddl.jax")
    raises(lambda: jax.vmap(lambda v: hvd.allreduce(v, name="e3"))(jnp.ones((2, 3))),
           TypeError, "vmap")
    # a shape mismatch across ranks, eagerly: MismatchError on every rank, naming both
    raises(lambda: hvd.allreduce(jnp.ones(3 + r), name="mismatch"), hvd.MismatchError,
           "mismatch", "rank 0", "rank 1")
    # inside jit: the leader's error comes out of the compiled step, on every rank
    raises(lambda: jax.jit(lambda v: hvd.allreduce(v, name="jit-mismatch"))(
        jnp.ones(2 + r)).block_until_ready(), jax.errors.JaxRuntimeError,
        "MismatchError", "jit-mismatch")
    raises(lambda: jax.jit(lambda v: hvd.allgather(v, name="jit-uneven"))(
        jnp.ones((1 + r, 2))).block_until_ready(), jax.errors.JaxRuntimeError,
        "jit-uneven", "different first dimensions")
    # trees whose flat buffers match but whose leaves differ ((3, 2) against (2, 3), keys
    # that differ): a MismatchError on every rank, not elements mixed by position
    shape = (3, 2) if r == 0 else (2, 3)
    raises(lambda: hvd.fused_allreduce({"w": jnp.ones(shape)}, name="trees"),
           hvd.MismatchError, "allreduce 'trees/1': shape mismatch")
    raises(lambda: hvd.broadcast_parameters({"w": jnp.ones(2), "xy"[r]: jnp.ones(2)},
                                            name="tree-keys"),
           hvd.MismatchError, "broadcast 'tree-keys/2': shape mismatch")
    # no arrays on one rank alone, eagerly: every rank's call fails at once
    raises(lambda: hvd.allreduce(None if r == 1 else jnp.ones(2), name="none"),
           TypeError if r == 1 else hvd.InvalidRequestError,
           *(("no arrays in it",) if r == 1 else
             ("allreduce 'none': rank 1 passed NoneType None, which has no arrays in it, to "
              "ddl.jax.allreduce",)))
    # the job is still usable afterwards, eagerly and inside jit
    check(np.allclose(hvd.allreduce(jnp.ones(2), name="after", op=hvd.Sum), n), "usable")
    got = jax.jit(lambda v: hvd.allreduce(v, name="after-jit", op=hvd.Sum))(jnp.ones(2))
    check(np.allclose(got, n), f"usable inside jit after an error: {got}")


def contract():
    """The collective contract of tests/_contract_checks.py over jax.Array."""
    import arrayimpl
    import _contract_checks
    impl = next(i for i in arrayimpl.IMPLS if i.name == "jax")
    fails.extend(_contract_checks.check_library(impl) + _contract_checks.check_mismatches(impl))


def main():
    hvd.init()
    rank = hvd.rank()
    for part in (jitted_collectives, lambda: one_collective_per_step(sys.argv[1]), gradients,
                 numerical_contract, compression, broadcasts, errors, contract):
        try:
            part()
        except Exception as e:  # noqa: BLE001 - report, and go on with the other parts
            import traceback
            fails.append(f"rank {rank}: {getattr(part, '__name__', part)} raised "
                         f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    everyone = hvd.allgather_object(fails)
    hvd.shutdown()
    problems = [f for per_rank in everyone for f in per_rank]
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    if rank == 0:
        print("JAX CHECKS OK")


if __name__ == "__main__":
    main()
