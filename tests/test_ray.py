"""ddl.ray.RayExecutor against a real Ray cluster of two nodes on this machine (a head
and a worker node, each its own raylet, ray.cluster_utils.Cluster): torch training as
one ddl job across the nodes, placement, Horovod's arguments, run_remote, callbacks fed
by ddl.ray.log, the secret sealed per actor, and a worker actor killed mid-job;
ddl.ray.ElasticRayExecutor, set up as Horovod's, going on without a worker that died, and
failing by name (the worker's error said at once) when too few remain. Skips, saying
why, where ray is not installed."""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import threading
import time

import pytest

from ddl import RunError

WHY = None if importlib.util.find_spec("ray") and importlib.util.find_spec("cryptography") \
    else "ray or cryptography is not installed (pip install -e '.[dev]')"
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no Ray: {WHY}")


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster
    # Ray waits a fixed 30 s for a new raylet to register; on a busy 2-core machine the
    # first start can take longer ("The current node timed out during startup"): that
    # is the start of the test's engine, not what is tested, so it gets three tries
    for attempt in range(3):
        c = Cluster()
        try:
            c.add_node(num_cpus=2, include_dashboard=False)
            c.add_node(num_cpus=2)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception here
            c.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    ray.init(address=c.address, log_to_driver=True)
    yield c
    ray.shutdown()
    c.shutdown()


def _marked() -> dict:
    """The test's leak-check marker for the ranks' environment: Ray's workers do not
    inherit this process's, and the leak check finds what carries it."""
    return {"DDL_TEST_MARKER": os.environ["DDL_TEST_MARKER"]}


def _train(steps):
    """Data-parallel SGD on a linear model: every rank starts from rank 0's weights and
    trains on its own shard; returns what it saw."""
    import numpy as np
    import torch
    import ddl.torch as hvd
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rng = np.random.default_rng(hvd.rank())
    for _ in range(steps):
        x = torch.tensor(rng.standard_normal((8, 4)), dtype=torch.float32)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    w = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    every = hvd.allgather_object(w.tolist())
    return {"rank": hvd.rank(), "size": hvd.size(), "cross_size": hvd.cross_size(),
            "same": all(e == every[0] for e in every), "w": w.tolist(),
            "secret_in_env_of_actor": "DDL_JOB_SECRET" in os.environ}


class _Scaled:
    """An executable_cls: what Horovod's execute() hands its function on each rank."""

    def __init__(self, scale, offset=0):
        self.scale, self.offset = scale, offset
        self.calls = 0

    def bump(self):
        """The executable, module state and the job, kept from one call to the next."""
        import ddl
        import numpy as np
        self.calls += 1
        total = ddl.allreduce(np.array([self.calls]), name="bump", op=ddl.Sum)
        return self.calls, int(total[0]), os.getpid(), ddl.is_initialized()

    def value(self):
        import ddl
        import ddl.ray
        import numpy as np
        for step in range(3):  # rank 0's values reach the driver's callbacks, in order
            ddl.ray.log({"step": step, "rank": ddl.rank(), "loss": np.float32(0.5)})
        ddl.ray.log([ddl.rank()], chief_only=False)  # every rank's
        return self.scale * ddl.rank() + self.offset, os.environ.get("DDL_TEST_EXTRA")


def test_torch_training_across_two_ray_nodes(cluster):
    import ray
    from ddl.ray import RayExecutor
    settings = RayExecutor.create_settings(60)  # Horovod's order: timeout_s first
    # Horovod's order: (settings, num_workers, num_hosts, num_workers_per_host,
    # cpus_per_worker, use_gpu, gpus_per_worker, use_current_placement_group): 2 x 2
    executor = RayExecutor(settings, None, 2, 2, 1, False, None, True,
                           placement_strategy="SPREAD", env=_marked())
    executor.start(executable_cls=_Scaled, executable_args=(3,),
                   executable_kwargs={"offset": 1}, extra_env_vars={"DDL_TEST_EXTRA": "x"})
    try:
        assert len(executor.pids) == 4
        assert sorted(executor.node_ids.count(n) for n in set(executor.node_ids)) == [2, 2]
        out = executor.run(_train, args=(20,))
        assert [o["rank"] for o in out] == [0, 1, 2, 3]
        assert all(o["size"] == 4 and o["same"] for o in out)
        assert out[0]["w"] == out[3]["w"]
        # trained: the weights approach the true ones (all 1, bias 0)
        assert all(abs(v - 1.0) < 0.3 for v in out[0]["w"][:4])
        # a second job on the same actors, started by run_remote: one reference per rank
        refs = executor.run_remote(lambda k: __import__("ddl").rank() * k, args=[10])
        assert len(refs) == 4 and all(isinstance(r, ray.ObjectRef) for r in refs)
        assert ray.get(refs) == [0, 10, 20, 30]
        # Horovod's form: fn(executable), the executable made in each rank; callbacks get
        # what rank 0 logs (and every rank's chief_only=False values), JSON-plain
        logged = []
        assert executor.execute(lambda worker: worker.value(), callbacks=[logged.append]) == [
            (3 * r + 1, "x") for r in range(4)]
        chief = [v for v in logged if isinstance(v, dict)]
        assert chief == [{"step": i, "rank": 0, "loss": 0.5} for i in range(3)], logged
        assert sorted(v[0] for v in logged if isinstance(v, list)) == [0, 1, 2, 3], logged
        # rank 0 alone, in its process of the job: still a rank of 4, as in Horovod
        assert executor.execute_single(lambda worker: (worker.value(),
                                                       __import__("ddl").size())) == (
            (1, "x"), 4)
        # every call so far ran in the same processes, with the same executable: the
        # ranks' state (the executable, modules, the job itself) persists between calls
        first = executor.execute(lambda worker: worker.bump())
        second = executor.execute(lambda worker: worker.bump())
        assert [c[:2] for c in first] == [(1, 4)] * 4, first
        assert [c[:2] for c in second] == [(2, 8)] * 4, second
        pids = [c[2] for c in first]
        assert [c[2] for c in second] == pids and all(c[3] for c in second)
        assert executor.run(os.getpid) == pids
        assert len(set(pids) | set(executor.pids)) == 8  # not the actors' own processes
        # a call that raises on one rank fails as a whole, naming it, and ends the job
        # at once (rank 0 waits for rank 2 in an allreduce that rank 2 will never join)
        t0 = time.monotonic()
        with pytest.raises(RunError) as info:
            executor.run(_raise_on, args=(2,))
        took = time.monotonic() - t0
        print(f"a call raising on rank 2 failed the run in {took:.2f} s")
        assert took < 30
        assert info.value.rank == 2 and "ValueError: rank 2 has no data" in str(info.value)
        # the next call runs in a new job, in fresh processes, its executables new
        again = executor.execute(lambda worker: worker.bump())
        assert [c[:2] for c in again] == [(1, 4)] * 4, again
        assert not set(c[2] for c in again) & set(pids)
        # a call that shuts ddl down (Horovod scripts may end so) ends the job with its
        # answer; the next call starts a new one
        assert executor.run(lambda: __import__("ddl").shutdown()) == [None] * 4
        assert not set(executor.run(os.getpid)) & set(c[2] for c in again)
    finally:
        executor.shutdown()


def _raise_on(bad):
    import ddl
    import numpy as np
    if ddl.rank() == bad:
        raise ValueError(f"rank {bad} has no data")
    return ddl.allreduce(np.ones(3), name="never_met")


def test_secret_is_sealed_per_actor():
    from ddl.ray import _seal, _derive
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    from cryptography.exceptions import InvalidTag
    actor = X25519PrivateKey.generate()
    public = actor.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    secret = os.urandom(32).hex()
    driver_public, nonce, sealed = _seal(secret, public, rank=3)
    assert secret.encode() not in sealed and bytes.fromhex(secret) not in sealed
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    key = _derive(actor.exchange(X25519PublicKey.from_public_bytes(driver_public)))
    assert ChaCha20Poly1305(key).decrypt(nonce, sealed, b"rank 3").decode() == secret
    with pytest.raises(InvalidTag):  # bound to the rank: another actor cannot use it
        ChaCha20Poly1305(key).decrypt(nonce, sealed, b"rank 2")


def _slow_steps(marker):
    import numpy as np
    import ddl
    open(marker + f".{ddl.rank()}", "w").close()
    for step in range(100000):
        ddl.allreduce(np.ones(1000), name="s")
        time.sleep(0.01)
    return "unreachable"


def test_a_killed_worker_actor_fails_the_run_naming_it(cluster, tmp_path):
    import ray
    import ddl
    from ddl.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=3,
                           env=dict(_marked(), DDL_LIVENESS_TIMEOUT_SECONDS="3"))
    executor.start()
    victim = executor._actors[2]
    marker = str(tmp_path / "started")

    def kill_when_running():
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{marker}.{r}") for r in range(3)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        ray.kill(victim, no_restart=True)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ddl.RunError) as info:
            executor.run(_slow_steps, args=(marker,))
        took = time.monotonic() - t0
    finally:
        killer.join()
        executor.shutdown()
    err = info.value
    assert err.rank == 2, str(err)
    assert "the Ray actor of rank 2 died" in str(err)
    assert "ranks [0, 1] failed after it" in str(err)
    assert took < 60, took
    # nothing left (the leak check: the killed actor's rank died with it, the others ended)


def _freeze_rank(frozen):
    """Rank ``frozen`` stops itself (SIGSTOP) in the middle of the job; the others go on
    calling collectives, which fail once the job has lost it."""
    import signal
    import numpy as np
    import ddl
    if ddl.rank() == frozen:
        os.kill(os.getpid(), signal.SIGSTOP)
    for _ in range(1000):
        ddl.allreduce(np.ones(10), name="f")
        time.sleep(0.01)


def test_a_frozen_rank_fails_the_call_instead_of_hanging_it(cluster, monkeypatch):
    """A rank frozen mid-call (its process stopped) answers nothing; its peers fail at
    once (the job lost it), and END_S after the first failure the executor stops the
    frozen rank's actor: run raises RunError naming it instead of waiting forever."""
    import ddl
    import ddl.ray
    from ddl.ray import RayExecutor
    monkeypatch.setattr(ddl.ray, "END_S", 15.0)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=3,
                           env=_marked())
    executor.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ddl.RunError) as info:
            executor.run(_freeze_rank, args=(1,))
        took = time.monotonic() - t0
        with pytest.raises(ddl.RunError, match="the Ray actor of rank 1 was stopped"):
            executor.run(os.getpid)
    finally:
        executor.shutdown()
    assert info.value.rank == 1, str(info.value)
    assert "rank 1 was still running 15 s after another rank failed (frozen?)" \
        in str(info.value), str(info.value)
    assert "ranks [0, 2] failed after it" in str(info.value), str(info.value)
    assert took < 40, took
    # nothing left (the leak check): the stopped rank died with its actor


def _elastic_train(steps, kill_at, how="kill"):
    """Elastic training (as tests/_elastic_worker.py): each step allreduces a vector that
    depends on the step and the rank, commits, and logs (rank 0) the step and the size;
    worker 3 kills itself (``how="kill"``) or raises before step ``kill_at``. Returns
    what its worker saw."""
    import signal
    import numpy as np
    import ddl
    import ddl.elastic
    import ddl.ray
    me = int(os.environ["DDL_ELASTIC_WORKER"])
    state = ddl.elastic.ObjectState(step=0, w=np.zeros(4), schedule=[])

    @ddl.elastic.run
    def train(state):
        while state.step < steps:
            if me == 3 and state.step == kill_at:
                if how == "raise":
                    raise ValueError(f"worker 3 ran out of data at step {kill_at}")
                os.kill(os.getpid(), signal.SIGKILL)
            data = np.arange(4, dtype=np.float64) * (state.step + 1) + 10.0 * ddl.rank()
            state.w = state.w + ddl.allreduce(data, name="grad", op=ddl.Sum)
            state.schedule.append(ddl.size())
            state.step += 1
            state.commit()
            ddl.ray.log({"step": state.step, "size": ddl.size()})

    train(state)
    return {"worker": me, "rank": ddl.rank(), "size": ddl.size(), "w": state.w.tolist(),
            "schedule": state.schedule, "host": os.environ["DDL_HOSTNAME"]}


def _elastic_reference(schedule):
    import numpy as np
    w = np.zeros(4)
    for step, size in enumerate(schedule):
        w += sum(np.arange(4) * (step + 1) + 10.0 * r for r in range(size))
    return w


def test_elastic_executor_goes_on_without_a_dead_worker(cluster):
    """4 workers on the 2 nodes (2 slots each), min_workers=2; worker 3 kills itself
    before step 4: the other 3 go on from the last commit, and run returns their results
    in rank order, equal to the reference of the schedule 4 x 4 then 3 x 6."""
    import numpy as np
    from ddl.ray import ElasticRayExecutor
    from ddl.ray._elastic import RayDiscovery
    # the hosts: each node by its address (a second node on one address, as here, with
    # its id), with CPU // cpus_per_slot slots; none with GPUs asked of CPU-only nodes
    hosts = RayDiscovery(1, 0).find()
    assert sorted(hosts.values()) == [2, 2] and len({h.split("/")[0] for h in hosts}) == 1
    assert RayDiscovery(0.5, 0).find().keys() == hosts.keys()
    assert sorted(RayDiscovery(0.5, 0).find().values()) == [4, 4]
    assert RayDiscovery(1, 1).find() == {}
    # Horovod's form: the limits in the settings, (settings, use_gpu, cpus_per_slot,
    # gpus_per_slot, env_vars) in its order
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4,
                                                  elastic_timeout=60, timeout_s=60)
    executor = ElasticRayExecutor(settings, False, 1, None, _marked())
    executor.start()
    logged = []
    try:
        out = executor.run(_elastic_train, args=(10, 4), callbacks=[logged.append])
    finally:
        executor.shutdown()
    # what rank 0 logged after each commit, in order: no step twice, none missing
    assert logged == [{"step": i + 1, "size": 4 if i < 4 else 3} for i in range(10)], logged
    assert [o["rank"] for o in out] == [0, 1, 2] and all(o["size"] == 3 for o in out), out
    assert sorted(o["worker"] for o in out) == [0, 1, 2]
    assert len({o["host"] for o in out}) == 2  # the two nodes, one of them with 1 worker
    for o in out:
        assert o["schedule"] == [4] * 4 + [3] * 6, o
        np.testing.assert_allclose(o["w"], _elastic_reference(o["schedule"]))
    assert executor.history == [4, 3]
    # nothing left (the leak check): the dead worker's actor and the others' ended


def test_elastic_executor_names_why_when_too_few_remain(cluster, capsys):
    """min_num_proc 4 from the settings; worker 3 raises at step 2: its error is said at
    once (before the world waits for a 4th worker), the live lines name the executor's
    arguments, and the RunError names why the job ended and that first error."""
    import ddl
    from ddl.ray import ElasticRayExecutor
    settings = ElasticRayExecutor.create_settings(min_num_proc=4, elastic_timeout=8,
                                                  timeout_s=60)
    executor = ElasticRayExecutor(settings, env_vars=_marked())
    executor.start()
    try:
        with pytest.raises(ddl.RunError) as info:
            executor.run(_elastic_train, args=(10, 2, "raise"))
    finally:
        executor.shutdown()
    message = str(info.value)
    # 3 remain, or 2 when a survivor resetting was taken for lost too
    assert re.search(r"ElasticRayExecutor.run: fewer than min_workers 4 workers remain "
                     r"\([23]\) and no host brought more within elastic_timeout 8 s "
                     r"\(blacklisted: ", message), message
    assert message.endswith("; the first worker error: worker 3 raised ValueError: worker 3 "
                            "ran out of data at step 2"), message
    assert "ValueError: worker 3 ran out of data" in info.value.traceback
    err = capsys.readouterr().err
    said = re.search(r"ElasticRayExecutor: worker 3 \(Ray actor \w+\) raised ValueError: "
                     r"worker 3 ran out of data at step 2\n", err)
    waits = re.search(r"ElasticRayExecutor: world 1 waits: [23] worker\(s\) remain, fewer "
                      r"than min_workers 4; waiting up to 8 s \(elastic_timeout\)", err)
    assert said and waits and said.start() < waits.start(), err[-3000:]
    assert "--min-np" not in err and "--elastic-timeout" not in err, err[-3000:]


def test_executor_arguments(monkeypatch):
    """Both executors take Horovod's arguments in Horovod's order; the elastic limits
    stay in the settings and are the executor's defaults; bad values are named."""
    import ddl.ray
    from ddl.ray import ElasticRayExecutor, RayExecutor
    settings = ElasticRayExecutor.create_settings(2, 3, 1, 30, 20)  # Horovod's order
    assert (settings.min_num_proc, settings.max_num_proc, settings.reset_limit,
            settings.elastic_timeout, settings.timeout_s) == (2, 3, 1, 30.0, 20.0)
    executor = ElasticRayExecutor(settings, True, 2, 1, {"FOO": "1"})
    assert (executor.min_workers, executor.max_workers, executor.reset_limit,
            executor.elastic_timeout) == (2, 3, 1, 30.0)
    assert (executor.cpus_per_slot, executor.gpus_per_slot, executor.env) == (2, 1, {"FOO": "1"})
    assert executor.job_env["DDL_START_TIMEOUT"] == "20.0"
    # a keyword overrides the settings' value, and the settings say what is in force
    assert ElasticRayExecutor(settings, min_workers=1).settings.min_num_proc == 1
    aliased = ElasticRayExecutor.create_settings(min_np=2, max_np=2)  # Horovod's old names
    assert (aliased.min_num_proc, aliased.max_num_proc) == (2, 2)
    for make, error, message in [
            (lambda: ElasticRayExecutor(min_workers=0), ValueError,
             "min_workers must be an int >= 1, got 0"),
            (lambda: ElasticRayExecutor(min_workers=3, max_workers=2), ValueError,
             "min_workers 3 > max_workers 2"),
            (lambda: ElasticRayExecutor(settings, max_workers=1), ValueError,
             "min_workers 2 > max_workers 1"),
            (lambda: ElasticRayExecutor(reset_limit=-1), ValueError,
             "reset_limit must be an int >= 0, got -1"),
            (lambda: ElasticRayExecutor(override_discovery=False), ValueError,
             "override_discovery=False (a host discovery script) is not supported"),
            (lambda: ElasticRayExecutor(cpus_per_slot=0), ValueError,
             "cpus_per_slot must be > 0, got 0"),
            (lambda: ElasticRayExecutor(settings, False, 1, 2), ValueError,
             "gpus_per_slot=2 asks for GPUs but use_gpu is False; pass use_gpu=True"),
            (lambda: ElasticRayExecutor(env_vars={}, env={}), ValueError,
             "give env_vars (Horovod's name) or env, not both"),
            (lambda: ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2),
             ValueError, "ElasticRayExecutor.create_settings: min_num_proc 3 > "
                         "max_num_proc 2"),
            (lambda: ElasticRayExecutor.create_settings(elastic_timeout=0), ValueError,
             "elastic_timeout must be a number of seconds > 0, got 0"),
            (lambda: ElasticRayExecutor.create_settings(min_workers=2), TypeError,
             "unexpected argument(s) min_workers"),
            (lambda: RayExecutor(num_workers=2, gpus_per_worker=1), ValueError,
             "RayExecutor: gpus_per_worker=1 asks for GPUs but use_gpu is False"),
            (lambda: RayExecutor(min_workers=2, max_workers=4), ValueError,
             "RayExecutor: min_workers=2, max_workers=4 asks for an elastic job, which ddl "
             "runs with ElasticRayExecutor"),
            (lambda: RayExecutor.create_settings(timeout_s=0), ValueError,
             "timeout_s must be a number of seconds > 0, got 0")]:
        with pytest.raises(error) as info:
            make()
        assert message in str(info.value), (message, str(info.value))
    with pytest.raises(RuntimeError, match="call start"):
        ElasticRayExecutor().run(print)
    # RayExecutor: Horovod's positions (num_hosts x num_workers_per_host), its flags
    assert RayExecutor(None, None, 2, 3).num_workers == 6
    assert RayExecutor(None, 2, use_current_placement_group=False).use_current_placement_group \
        is False
    assert RayExecutor.create_settings(45).timeout_s == 45.0
    with pytest.raises(RuntimeError, match="RayExecutor.run_remote: call start"):
        RayExecutor(num_workers=1).run_remote(print)
    # ddl.ray.log: nothing outside a job with callbacks; a value JSON cannot carry, named
    monkeypatch.delenv("DDLRAY_LOG", raising=False)
    ddl.ray.log({"step": 1}, chief_only=False)
    monkeypatch.setenv("DDLRAY_LOG", "1 token")
    with pytest.raises(TypeError, match="ddl.ray.log: object values cannot be sent as JSON"):
        ddl.ray.log({"x": object()}, chief_only=False)


def test_the_log_channel_and_the_callbacks_bounds(cluster, monkeypatch):
    """The pieces of ddl.ray.log's channel in this process, with a real Ray queue: a value
    is acknowledged once queued (so a call's values all reach its callbacks), dropped
    while no call has callbacks; a connection without the token is neither read nor
    answered; a callback that hangs past the close bound, and a queue that fails, are
    reported by check() instead of holding the job's end or losing values silently."""
    import socket
    import ddl.ray
    from ddl.ray import _actor
    relay = _actor._LogRelay(None)
    try:
        monkeypatch.setenv("DDLRAY_LOG", relay.env["DDLRAY_LOG"])
        ddl.ray.log({"dropped": 1}, chief_only=False)  # no callbacks: acknowledged, dropped
        got = []
        pump = _actor._callbacks([got.append])
        relay.queue = pump.queue
        for step in range(3):
            ddl.ray.log({"step": step}, chief_only=False)
        port = int(relay.env["DDLRAY_LOG"].split()[0])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
            stranger.sendall(b"0" * 32 + b"\n" + b'{"step": 99}\n')
            try:
                stranger.shutdown(socket.SHUT_WR)
                assert stranger.recv(1) == b""  # closed unanswered (its bytes unread)
            except (ConnectionResetError, OSError) as e:
                # closed unanswered, its bytes unread: a reset, or already gone when this
                # side shuts its half (ENOTCONN), as happens on a loaded machine
                assert isinstance(e, ConnectionResetError) or e.errno == errno.ENOTCONN, e
        relay.queue = None
        pump.close()
        pump.check()
        assert got == [{"step": 0}, {"step": 1}, {"step": 2}], got
    finally:
        relay.close()
    monkeypatch.setattr(_actor, "CALLBACKS_CLOSE_S", 0.5)
    release = threading.Event()
    hung = _actor._callbacks([lambda value: release.wait(30)])
    hung.queue.put(1)
    time.sleep(0.5)
    t0 = time.monotonic()
    hung.close()
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="was still running 0.5 s after the job ended"):
        hung.check()
    release.set()
    lost = _actor._callbacks([print])
    lost.queue.shutdown()  # the queue's actor gone while the job runs
    time.sleep(1)
    lost.close()
    with pytest.raises(RuntimeError, match="the callbacks' queue failed"):
        lost.check()


def test_the_ray_example_runs():
    """examples/ray_pytorch.py starts its own local Ray and trains on 2 actors."""
    import subprocess
    import sys
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples", "ray_pytorch.py")
    r = subprocess.run([sys.executable, example, "--num-workers", "2", "--epochs", "2"],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK") and "rank 1: final loss" in r.stdout
