"""Elastic training on Ray: :class:`ElasticRayExecutor`, with the shape of Horovod's.

::

    from ddl.ray import ElasticRayExecutor
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=8,
                                                  elastic_timeout=600, timeout_s=60)
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1)
    executor.start()
    results = executor.run(train)   # train uses ddl.elastic.run and a State
    executor.shutdown()

The job is the one ``ddlrun --min-np/--max-np`` runs (:mod:`ddl.launcher.elastic.driver`,
docs/elastic.md), with two parts swapped: the hosts are the Ray cluster's alive nodes,
each with ``CPU // cpus_per_slot`` slots (and no more than ``GPU // gpus_per_slot`` with
``use_gpu``), read every second (:class:`RayDiscovery`); and each worker is a Ray actor
pinned to its node (``NodeAffinitySchedulingStrategy``, not soft) that starts the worker
as a fresh process with the elastic environment (the driver's address, the worker's
number, the job id; the job secret sealed for that actor as ``ddl.ray.RayExecutor``
seals it, never in clear through Ray nor on a command line). A node that joins the
cluster gets workers (up to ``max_workers``) at the next commit; a worker that dies, or
whose node leaves, is dropped and the others go on from the last commit.

:meth:`ElasticRayExecutor.run` returns the results of the final world's workers, in rank
order; it raises :class:`ddl.RunError` naming why when the job fails (fewer than
``min_workers`` remain and no node brought more within ``elastic_timeout``, more than
``reset_limit`` resets, a worker's failure left nothing to go on with), and the first
worker error (its traceback in the error's ``traceback``). A worker that raises is named
with its error on stderr as soon as its actor reports it, not only at the end.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl import RunError
from ddl._client_api import elastic_discovery, elastic_driver, engine_ranks
from ddl.ray._actor import (ElasticSettings, Settings, _callbacks, _seal, _Worker,
                           check_limits, create_elastic_settings)

# what an elastic worker needs from the driver's environment for it (the rest of the
# driver's environment is the driver's, not the node's)
_WORKER_VARS = ("DDL_JOB_ID", "DDL_ELASTIC_WORKER", "DDL_HOSTNAME", "DDL_ELASTIC_ADDR",
                "PYTHONUNBUFFERED")
_UNBOUNDED = 1 << 20
# the driver's messages name ddlrun's flags; here they are the executor's arguments
_ARGUMENTS = (("--min-np", "min_workers"), ("--max-np", "max_workers"),
              ("--elastic-timeout", "elastic_timeout"), ("--reset-limit", "reset_limit"),
              ("its link to ddlrun", "its link to the driver"))


def _renamed(text: str) -> str:
    """A driver message with the executor's argument names for ddlrun's flags."""
    for flag, argument in _ARGUMENTS:
        text = text.replace(flag, argument)
    return text


class _Log:
    """The elastic driver's log stream: its lines, in the executor's words, to this
    process's stderr (as it is when each line is written)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(_renamed(text))

    def flush(self) -> None:
        sys.stderr.flush()


class RayDiscovery:
    """The hosts of an elastic job on Ray: every alive node with a slot, ``{name:
    slots}`` (the discovery interface of :mod:`ddl.launcher.elastic.discovery`). A node
    is named by its address; a second node on the same address (several raylets on one
    machine) by ``address/node-id-prefix``. Names are kept for a node's life."""

    polled = True

    def __init__(self, cpus_per_slot: float, gpus_per_slot: float):
        self.cpus_per_slot, self.gpus_per_slot = cpus_per_slot, gpus_per_slot
        self.problem = ""
        self._names: Dict[str, str] = {}  # Ray node id -> host name
        self._nodes: Dict[str, str] = {}  # host name -> Ray node id
        self._last: Dict[str, int] = {}

    def find(self) -> Dict[str, int]:
        import ray
        try:
            nodes = ray.nodes()
        except Exception as exc:  # noqa: BLE001 - the GCS unreachable: keep the last
            self.problem = f"ray.nodes() failed: {type(exc).__name__}: {exc}"
            return dict(self._last)
        hosts: Dict[str, int] = {}
        for node in nodes:
            if not node.get("Alive"):
                continue
            resources = node.get("Resources") or {}
            slots = int(resources.get("CPU", 0) // self.cpus_per_slot) \
                if self.cpus_per_slot else _UNBOUNDED
            if self.gpus_per_slot:
                slots = min(slots, int(resources.get("GPU", 0) // self.gpus_per_slot))
            if slots >= 1:
                hosts[self._name(node)] = slots
        self.problem, self._last = "", hosts
        return dict(hosts)

    def _name(self, node: Mapping[str, Any]) -> str:
        node_id = node["NodeID"]
        if node_id not in self._names:
            address = str(node.get("NodeManagerAddress") or "node")
            name = address if address not in self._nodes else f"{address}/{node_id[:8]}"
            self._names[node_id], self._nodes[name] = name, node_id
        return self._names[node_id]

    def node_id(self, host: str) -> str:
        return self._nodes[host]


class _ActorWorker:
    """An elastic worker run by a Ray actor (the driver's ``WorkerProcess`` interface):
    a thread gets the actor's public key, seals the secret for it, runs the worker and
    records its row, saying at once when the worker raised; the actor is killed once the
    worker ended, which frees its slot. A Ray actor is ended, not signalled: every
    signal kills it (and so the worker's process, which dies with its actor)."""

    stdout = stderr = None  # the worker's output goes through Ray's log forwarding

    def __init__(self, actor: Any, index: int, secret: str, payload: bytes,
                 env: Dict[str, str], start_timeout: float, log: Callable[[str], None],
                 queue: Any = None):
        self._actor, self.index = actor, index
        actor_id = getattr(getattr(actor, "_actor_id", None), "hex", lambda: "")()
        self.name = f"Ray actor {actor_id[:8]}" if actor_id else "Ray actor"
        self.returncode: Optional[int] = None
        self.result: Any = None
        self.traceback = ""
        self.ended_at = float("inf")  # when the worker ended (time.monotonic())
        self._done = threading.Event()
        threading.Thread(target=self._run,
                         args=(secret, payload, env, start_timeout, log, queue),
                         daemon=True, name=f"ddl-ray-elastic-worker {index}").start()

    def _run(self, secret: str, payload: bytes, env: Dict[str, str], start_timeout: float,
             log: Callable[[str], None], queue: Any) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        code, result, tb = 1, None, ""
        try:
            public = ray.get(self._actor.hello.remote(), timeout=start_timeout)[1]
            ref = self._actor.run_elastic.remote(payload, _seal(secret, public, self.index),
                                                 env, queue)
            _, code, result, tb = ray.get(ref)
        except GetTimeoutError:
            tb = (f"the Ray actor of worker {self.index} did not start within "
                  f"{start_timeout:g} s (timeout_s): are its node's resources taken?")
            log(f"warning: {tb}")
        except RayError as exc:  # killed (by the driver, or its node was lost)
            code, tb = -9, f"the Ray actor of worker {self.index} died: {type(exc).__name__}"
        self.ended_at = time.monotonic()
        if code != 0 and "Traceback" in tb:
            log(f"worker {self.index} ({self.name}) {error_line(tb)}")
        self.returncode, self.result, self.traceback = code, result, tb
        self._kill()
        self._done.set()

    def _kill(self) -> None:
        import ray
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def wait(self) -> int:
        self._done.wait()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self.returncode if self._done.is_set() else None

    def signal(self, signum: int) -> None:
        self._kill()

    def stop(self, grace_s: float) -> None:
        self._kill()
        self._done.wait(grace_s)


class _Starter:
    """Starts the job's workers as actors pinned to their nodes (the driver's starter)."""

    def __init__(self, executor: "ElasticRayExecutor", discovery: RayDiscovery,
                 payload: bytes, queue: Any = None):
        self._executor, self._discovery, self._payload = executor, discovery, payload
        self._queue = queue  # the callbacks' queue (None: no callbacks)
        self.workers: Dict[int, _ActorWorker] = {}

    def __call__(self, index: int, host: str, slot: int, env: Dict[str, str]) -> _ActorWorker:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ex = self._executor
        secret = env["DDL_JOB_SECRET"]  # sealed for the actor below, never sent in clear
        forwarded = {k: env[k] for k in _WORKER_VARS + tuple(ex.job_env) if k in env}
        forwarded.pop("DDL_JOB_SECRET", None)
        forwarded["DDL_ELASTIC_ADDR"] = forwarded["DDL_ELASTIC_ADDR"].replace(
            elastic_driver.LAUNCHER_PLACEHOLDER, ex.driver_address)
        actor = ex._actor_class.options(
            num_cpus=ex.cpus_per_slot, num_gpus=ex.gpus_per_slot,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                self._discovery.node_id(host), soft=False)).remote(index)
        worker = _ActorWorker(actor, index, secret, self._payload, forwarded,
                              ex.settings.timeout_s, ex._log, self._queue)
        self.workers[index] = worker
        return worker

    def close(self, grace_s: float = 10.0) -> None:
        for worker in self.workers.values():
            worker.signal(9)
        for worker in self.workers.values():
            worker.stop(grace_s)

    def first_error(self) -> Tuple[int, str]:
        """(worker, traceback) of the worker whose error came first, one that raised
        before one that only died; (-1, "") when none failed."""
        failed = sorted((w.ended_at, w.index, w.traceback) for w in self.workers.values()
                        if w.traceback)
        raised = [row for row in failed if "Traceback" in row[2]]
        _, index, tb = (raised or failed or [(0, -1, "")])[0]
        return index, tb


def error_line(tb: str) -> str:
    """How a worker's traceback ends, as a phrase: ``raised ValueError: ...``."""
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    return f"raised {last}" if "Traceback" in tb else last


def _elastic_settings(settings: Optional[Settings], min_workers: Optional[int],
                      max_workers: Optional[int], reset_limit: Optional[int],
                      elastic_timeout: Optional[float],
                      verbose: Optional[bool]) -> ElasticSettings:
    """``settings`` as :class:`ElasticSettings` (plain :class:`Settings` get the default
    limits) with each keyword given in place of its value; ValueError names a bad one."""
    if settings is None:
        settings = ElasticSettings()
    elif not isinstance(settings, Settings):
        raise TypeError(f"ElasticRayExecutor: settings must come from "
                        f"ElasticRayExecutor.create_settings(...), got "
                        f"{type(settings).__name__}")
    elif not isinstance(settings, ElasticSettings):
        settings = ElasticSettings(settings.timeout_s, settings.placement_group_timeout_s)
    given = {"min_num_proc": min_workers, "max_num_proc": max_workers,
             "reset_limit": reset_limit, "elastic_timeout": elastic_timeout,
             "verbose": verbose}
    settings = replace(settings, **{k: v for k, v in given.items() if v is not None})
    check_limits("ElasticRayExecutor", min_workers=settings.min_num_proc,
                 max_workers=settings.max_num_proc, reset_limit=settings.reset_limit)
    timeout = settings.elastic_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"ElasticRayExecutor: elastic_timeout must be a number of seconds "
                         f"> 0, got {timeout!r}")
    return replace(settings, elastic_timeout=float(timeout))


class ElasticRayExecutor:
    """Elastic ddl jobs on a Ray cluster (see the module doc), with Horovod's arguments
    in Horovod's order: ``settings`` from :meth:`create_settings` (the elastic limits:
    ``min_num_proc``, ``max_num_proc``, ``reset_limit``, ``elastic_timeout``), ``use_gpu``,
    ``cpus_per_slot`` CPUs per worker and, with ``use_gpu``, ``gpus_per_slot`` GPUs (1 by
    default), ``env_vars`` for every worker's environment, ``override_discovery`` (only
    True: the hosts are the cluster's nodes).

    The keywords ``min_workers`` (the fewest the job goes on with), ``max_workers`` (the
    most; None: as many as the nodes have slots), ``reset_limit`` (the most new worlds
    after the first), ``elastic_timeout`` (the longest a change may take, seconds) and
    ``verbose`` override the settings' values; ``env`` is ``env_vars``'s other name.
    ``self.settings`` holds the values in force."""

    create_settings = staticmethod(create_elastic_settings)

    def __init__(self, settings: Optional[Settings] = None, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[Mapping[str, str]] = None, override_discovery: bool = True,
                 *, min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, elastic_timeout: Optional[float] = None,
                 env: Optional[Mapping[str, str]] = None, verbose: Optional[bool] = None):
        self.settings = _elastic_settings(settings, min_workers, max_workers, reset_limit,
                                          elastic_timeout, verbose)
        if gpus_per_slot and not use_gpu:
            raise ValueError(f"ElasticRayExecutor: gpus_per_slot={gpus_per_slot!r} asks for "
                             f"GPUs but use_gpu is False; pass use_gpu=True with it")
        if not override_discovery:
            raise ValueError("ElasticRayExecutor: override_discovery=False (a host discovery "
                             "script) is not supported: the hosts are the Ray cluster's alive "
                             "nodes; run ddlrun --host-discovery-script for a script")
        if isinstance(cpus_per_slot, bool) or not isinstance(cpus_per_slot, (int, float)) \
                or not cpus_per_slot > 0:
            raise ValueError(f"ElasticRayExecutor: cpus_per_slot must be > 0, got "
                             f"{cpus_per_slot!r}")
        if env_vars is not None and env is not None:
            raise ValueError("ElasticRayExecutor: give env_vars (Horovod's name) or env, "
                             "not both")
        self.min_workers, self.max_workers = (self.settings.min_num_proc,
                                              self.settings.max_num_proc)
        self.reset_limit = self.settings.reset_limit
        self.elastic_timeout = self.settings.elastic_timeout
        self.verbose = self.settings.verbose
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = (gpus_per_slot or 1) if use_gpu else 0
        self.env = dict(env_vars if env_vars is not None else env or {})
        self.driver_address = ""  # this process's node address (after start)
        self._actor_class = None
        self._starter: Optional[_Starter] = None
        self.history: List[int] = []  # the size of every world of the last run

    @property
    def job_env(self) -> Dict[str, str]:
        """What every worker's environment gets besides its elastic variables."""
        return dict(self.env, DDL_START_TIMEOUT=str(self.settings.timeout_s),
                    DDL_ELASTIC_TIMEOUT=str(self.elastic_timeout))

    def start(self) -> None:
        """Connect to Ray (``ray.init()`` when it is not yet) and get ready to run."""
        import ray
        if not ray.is_initialized():
            ray.init()
        self._actor_class = ray.remote(_Worker)
        self.driver_address = ray.util.get_node_ip_address()

    def run(self, fn: Callable, args: Sequence = (),
            kwargs: Optional[Mapping[str, Any]] = None,
            callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` as one elastic job (every worker calls it after
        ``ddl.init()``; it trains under ``ddl.elastic.run``); the final world's results
        in rank order, or :class:`ddl.RunError` naming why the job failed and the first
        worker error (its ``rank`` -1: the job failed, not one rank; its ``traceback``
        that worker's, or a survivor's such as NotEnoughRanksError). ``callbacks``, as
        Horovod's: each is called on the driver with every value a worker of rank 0
        sends with :func:`ddl.ray.log`, in order; a callback's exception is raised
        once the job ended."""
        if self._actor_class is None:
            raise RuntimeError("ElasticRayExecutor.run: call start() first")
        discovery = RayDiscovery(self.cpus_per_slot, self.gpus_per_slot)
        pump = _callbacks(callbacks)
        starter = self._starter = _Starter(self, discovery,
                                           engine_ranks.pickle_call(fn, args, kwargs),
                                           pump.queue if pump else None)
        most = self.max_workers or _UNBOUNDED
        job = elastic_driver.ElasticJob(
            [], min_np=self.min_workers, max_np=most, np=most, discovery=discovery,
            blacklist=elastic_discovery.Blacklist(), elastic_timeout=self.elastic_timeout,
            reset_limit=self.reset_limit, start_timeout=self.settings.timeout_s,
            extra_env=self.job_env, verbose=self.verbose, stderr=_Log(),
            log_prefix="ElasticRayExecutor", starter=starter)
        try:
            job.start()
            result = job.wait()
        finally:
            job.close()
            starter.close()
            self._starter = None
            if pump is not None:
                pump.close()
        self.history = list(job.history)
        if result.exit_code != 0:
            raise self._failure(result, starter)
        if pump is not None:
            pump.check()
        return [starter.workers[i].result for i in job.members]

    def _failure(self, result: Any, starter: _Starter) -> RunError:
        """The job's failure: why it ended, and the first worker error."""
        why = _renamed(result.summary or f"the job ended with code {result.exit_code}")
        index, tb = starter.first_error()
        if tb:
            why += f"; the first worker error: worker {index} {_renamed(error_line(tb))}"
        return RunError(f"ElasticRayExecutor.run: {why}", rank=-1, exitcode=result.exit_code,
                        traceback=tb)

    def shutdown(self) -> None:
        """Stop what a run left (safe to call twice)."""
        if self._starter is not None:
            self._starter.close()
            self._starter = None
        self._actor_class = None

    def _log(self, text: str) -> None:
        print(f"ElasticRayExecutor: {_renamed(text)}", file=sys.stderr, flush=True)

    def __enter__(self) -> "ElasticRayExecutor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
