"""ddl on Ray: :class:`RayExecutor`, with the shape of Horovod's.

::

    from ddl.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4,
                           cpus_per_worker=1)
    executor.start()
    results = executor.run(train, args=(config,))   # one result per rank, in rank order
    executor.shutdown()

``start()`` reserves one placement-group bundle per worker (``PACK`` by default: fill a
node before the next; ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD`` as Ray defines
them) and starts one actor in each; actor ``i`` is rank ``i``. Each ``run``/``execute``
is one ddl job: every actor starts its rank as a fresh process
(:mod:`ddl.launcher.engine_ranks`), and the ranks meet at rank 0's node
(:mod:`ddl.startup.tcp_rendezvous`), the first rank on each node starting that node's
coordinator.

The job secret never enters Ray's object store in clear, nor a command line: each actor
makes an X25519 key pair and publishes its public key; the driver seals the secret for
each actor (X25519 with a fresh driver key, HKDF-SHA256, ChaCha20-Poly1305 bound to the
actor's rank), so what travels through Ray is ciphertext only.

Each job's ranks are fresh processes: what one job leaves in a module or in the
executable is gone in the next (Horovod's actors keep theirs); carry state in the
results, or in files. :meth:`run_remote` returns one ``ray.ObjectRef`` per rank at once.
Horovod's ``ray_logger.log`` is :func:`ddl.ray.log`: what rank 0 logs during a job reaches
every callback given to ``run``/``execute`` on the driver, in order (see
:mod:`ddl.ray._actor` for the channel).

Failure: if any rank fails, or an actor dies, :meth:`run` raises :class:`ddl.RunError`
naming the rank whose failure came first; the others end with named errors within the
liveness timeout. Needs ``pip install 'ddl-train[ray]'`` (ray, cryptography).

:class:`ElasticRayExecutor` (:mod:`ddl.ray._elastic`) runs elastic jobs: workers come and
go with the cluster's nodes, each an actor of the same kind, the secret sealed the same way.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl import RunError
from ddl._client_api import engine_ranks
from ddl.ray._actor import (ElasticSettings, Settings, _callbacks, _derive, _seal,  # noqa: F401
                           _Worker, create_settings, log)
from ddl.ray._elastic import ElasticRayExecutor

__all__ = ["RayExecutor", "ElasticRayExecutor", "RunError", "log"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RayExecutor:
    """A group of Ray actors that run ddl jobs (see the module doc), with Horovod's
    arguments in Horovod's order: ``num_workers`` actors with ``cpus_per_worker`` CPUs
    and, with ``use_gpu``, ``gpus_per_worker`` GPUs each (1 by default); or ``num_hosts``
    × ``num_workers_per_host`` workers. With ``use_current_placement_group`` (the
    default) and a placement group current where this runs (a Ray Tune trial, say), the
    actors go into its bundles, and :meth:`shutdown` leaves it; otherwise :meth:`start`
    reserves one of its own. ``placement_strategy`` chooses how its bundles land on nodes.
    ``env`` adds variables to every rank's environment.

    Horovod's elastic arguments (``min_workers``, ``max_workers``, ``reset_limit``,
    ``cooldown_range``) are refused with a ValueError that names
    :class:`ElasticRayExecutor`, which runs elastic jobs here; ``elastic_timeout`` and
    ``override_discovery`` matter only with them, as in Horovod."""

    create_settings = staticmethod(create_settings)

    def __init__(self, settings: Optional[Settings] = None, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True, min_workers: Optional[int] = None,
                 max_workers: Optional[int] = None, reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Sequence[int]] = None, elastic_timeout: float = 600,
                 override_discovery: bool = True, *, placement_strategy: str = "PACK",
                 env: Optional[Mapping[str, str]] = None):
        _refuse_elastic(min_workers=min_workers, max_workers=max_workers,
                        reset_limit=reset_limit, cooldown_range=cooldown_range)
        if num_workers is None:
            if num_hosts is None:
                raise ValueError("RayExecutor: give num_workers, or num_hosts and "
                                 "num_workers_per_host")
            num_workers = num_hosts * num_workers_per_host
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"RayExecutor: num_workers must be an int >= 1, got "
                             f"{num_workers!r}")
        if placement_strategy not in STRATEGIES:
            raise ValueError(f"RayExecutor: placement_strategy must be one of "
                             f"{', '.join(STRATEGIES)}, got {placement_strategy!r}")
        if gpus_per_worker and not use_gpu:
            raise ValueError(f"RayExecutor: gpus_per_worker={gpus_per_worker!r} asks for GPUs "
                             f"but use_gpu is False; pass use_gpu=True with it")
        if use_gpu and gpus_per_worker is not None and not gpus_per_worker > 0:
            raise ValueError(f"RayExecutor: gpus_per_worker must be > 0 with use_gpu, got "
                             f"{gpus_per_worker!r}")
        self.settings = settings or Settings()
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.placement_strategy = placement_strategy
        self.env = dict(env or {})
        self._actors: List[Any] = []
        self._executable: Optional[Tuple[Any, Sequence, Mapping[str, Any]]] = None
        self._group = None  # the placement group start() made (None: none, or the current)
        self._publics: List[bytes] = []
        self.nodes: List[str] = []  # each rank's node address, after start()
        self.pids: List[int] = []  # each rank's actor pid, after start()
        self.node_ids: List[str] = []  # each rank's Ray node, after start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence] = None,
              executable_kwargs: Optional[Mapping[str, Any]] = None,
              extra_env_vars: Optional[Mapping[str, str]] = None) -> None:
        """Reserve the placement group and start the actors (raises if the resources do
        not come within ``placement_group_timeout_s``). As Horovod's: ``executable_cls``
        (with its args) is what :meth:`execute` hands ``fn`` on each rank, made in the
        rank for each job; ``extra_env_vars`` join the ranks' environment."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if self._actors:
            raise RuntimeError("RayExecutor.start: already started")
        if executable_cls is not None:
            self._executable = (executable_cls, tuple(executable_args or ()),
                                dict(executable_kwargs or {}))
        self.env.update(extra_env_vars or {})
        group, own = self._placement_group()
        self._group = group if own else None
        actor = ray.remote(_Worker)
        self._actors = [actor.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i if own else -1,
                placement_group_capture_child_tasks=False)).remote(i)
            for i in range(self.num_workers)]
        hellos = ray.get([a.hello.remote() for a in self._actors],
                         timeout=self.settings.placement_group_timeout_s)
        self.nodes = [h[0] for h in hellos]
        self._publics = [h[1] for h in hellos]
        self.pids = [h[2] for h in hellos]
        self.node_ids = [h[3] for h in hellos]

    def _placement_group(self) -> Tuple[Any, bool]:
        """(the placement group the actors go into, whether this executor made it): the
        current one (``use_current_placement_group``), or one bundle per worker reserved
        now (raises RuntimeError if the resources do not come within
        ``placement_group_timeout_s``)."""
        import ray
        from ray.util.placement_group import (get_current_placement_group, placement_group,
                                              remove_placement_group)
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            return current, False
        bundle: Dict[str, float] = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        group = placement_group([dict(bundle) for _ in range(self.num_workers)],
                                strategy=self.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.settings.placement_group_timeout_s)
        except Exception as exc:
            remove_placement_group(group)
            raise RuntimeError(
                f"RayExecutor.start: {self.num_workers} bundles of {bundle} "
                f"({self.placement_strategy}) were not available within "
                f"{self.settings.placement_group_timeout_s:g} s ({type(exc).__name__}); "
                f"the cluster has {ray.cluster_resources()}") from None
        return group, True

    def shutdown(self) -> None:
        """Stop the actors and release the placement group start() made (safe to call
        twice)."""
        import ray
        from ray.util.placement_group import remove_placement_group
        for a in self._actors:
            ray.kill(a, no_restart=True)
        self._actors = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    # -- jobs -------------------------------------------------------------------------------
    def run(self, fn: Callable, args: Optional[Sequence] = None,
            kwargs: Optional[Mapping[str, Any]] = None,
            callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank as one ddl job; the results in rank
        order, or :class:`ddl.RunError` naming the rank that failed first. ``callbacks``,
        as Horovod's: each is called here with every value rank 0 sends with
        :func:`ddl.ray.log`, in order, while the job runs; the first exception a callback
        raises stops them and is raised once the job ended."""
        pump = _callbacks(callbacks)
        try:
            refs = self._submit("RayExecutor.run", "run", fn, args, kwargs,
                                pump.queue if pump else None)
            rows = [self._row(rank, ref) for rank, ref in enumerate(refs)]
        finally:
            if pump is not None:
                pump.close()
        results = engine_ranks.results(rows, len(rows), "RayExecutor.run")
        if pump is not None:
            pump.check()
        return results

    def run_remote(self, fn: Callable, args: Optional[Sequence] = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> List[Any]:
        """Horovod's ``run_remote``: start ``fn(*args, **kwargs)`` on every rank as one
        ddl job and return at once one ``ray.ObjectRef`` per rank, in rank order;
        ``ray.get`` of a reference gives that rank's result, or raises (a RayTaskError
        that is a :class:`ddl.RunError`) naming the rank and its error. Start no other
        job on these actors before every reference resolved."""
        return self._submit("RayExecutor.run_remote", "run_result", fn, args, kwargs)

    def _submit(self, who: str, method: str, fn: Callable, args: Optional[Sequence],
                kwargs: Optional[Mapping[str, Any]], queue: Any = None) -> List[Any]:
        """Start one job of ``fn`` on every actor (its ``method``): their references."""
        import ray
        if not self._actors:
            raise RuntimeError(f"{who}: call start() first")
        size, secret = len(self._actors), secrets.token_hex(32)
        port = ray.get(self._actors[0].free_port.remote(), timeout=30)
        host = self.nodes[0]
        rendezvous = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        payload = engine_ranks.pickle_call(fn, tuple(args or ()), kwargs)
        return [getattr(a, method).remote(payload, size, rendezvous,
                                          _seal(secret, self._publics[r], r),
                                          self.settings.timeout_s, self.env, queue)
                for r, a in enumerate(self._actors)]

    @staticmethod
    def _row(rank: int, ref: Any) -> Tuple[int, int, Any, str]:
        """Rank ``rank``'s row, or one that says its actor died."""
        import ray
        from ray.exceptions import RayError
        try:
            return ray.get(ref)
        except RayError as exc:  # the actor died (killed, its node lost)
            return rank, -9, None, f"the Ray actor of rank {rank} died: {type(exc).__name__}"

    def execute(self, fn: Callable[..., Any],
                callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """Horovod's ``execute``: ``fn(executable)`` on every rank as one ddl job, where
        ``executable`` is an instance of :meth:`start`'s ``executable_cls`` made in that
        rank for this job (None without one); a ``fn`` that takes no argument is called
        as ``fn()``. The results in rank order; ``callbacks`` as :meth:`run`'s."""
        return self.run(_execute, (fn, self._executable, _takes_an_argument(fn)),
                        callbacks=callbacks)

    def execute_single(self, fn: Callable[..., Any]) -> Any:
        """Horovod's ``execute_single``: :meth:`execute` on rank 0 alone (a job of one
        rank, on the first actor); its result."""
        if not self._actors:
            raise RuntimeError("RayExecutor.execute_single: call start() first")
        actors, publics, nodes = self._actors, self._publics, self.nodes
        self._actors, self._publics, self.nodes = actors[:1], publics[:1], nodes[:1]
        try:
            return self.execute(fn)[0]
        finally:
            self._actors, self._publics, self.nodes = actors, publics, nodes

    def __enter__(self) -> "RayExecutor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _refuse_elastic(**elastic: Any) -> None:
    """Horovod's elastic RayExecutor (``min_workers=`` ...) is ElasticRayExecutor here."""
    given = {k: v for k, v in elastic.items() if v is not None}
    if given:
        named = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"RayExecutor: {named} asks for an elastic job, which ddl runs with "
            f"ElasticRayExecutor: ElasticRayExecutor(ElasticRayExecutor.create_settings("
            f"min_num_proc=..., max_num_proc=..., reset_limit=..., elastic_timeout=...), "
            f"use_gpu, cpus_per_slot), then start() and run(fn)")


def _takes_an_argument(fn: Callable) -> bool:
    """Whether ``fn`` can be called with one positional argument (Horovod's
    ``execute(lambda worker: ...)``) rather than none."""
    import inspect
    try:
        inspect.signature(fn).bind(None)
        return True
    except TypeError:
        return False
    except ValueError:   # no signature to read (a builtin): Horovod's form
        return True


def _execute(fn: Callable, executable, with_argument: bool) -> Any:
    """What :meth:`RayExecutor.execute` runs on each rank."""
    if executable is not None:
        cls, args, kwargs = executable
        executable = cls(*args, **kwargs)
    return fn(executable) if with_argument else fn()
