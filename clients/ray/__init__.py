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
them), starts one actor in each (actor ``i`` is rank ``i``), and starts the job: every
actor starts its rank as a process of its own that stays up
(:class:`ddl.launcher.engine_ranks.RankServer`), the ranks meeting at rank 0's node
(:mod:`ddl.startup.tcp_rendezvous`), the first rank on each node starting that node's
coordinator; then each rank makes its ``executable_cls`` instance. Every
``run``/``execute`` runs in those processes, as Horovod's run in its actors: modules,
the executable and ddl itself (``ddl.init()`` again is a no-op) keep their state from
one call to the next.

The job secret never enters Ray's object store in clear, nor a command line: each actor
makes an X25519 key pair and publishes its public key; the driver seals the secret for
each actor (X25519 with a fresh driver key, HKDF-SHA256, ChaCha20-Poly1305 bound to the
actor's rank), so what travels through Ray is ciphertext only.

A call that raises on a rank ends that rank (so the others fail at once instead of
waiting for it in a collective), and the call raises :class:`ddl.RunError`; the next
call starts a new job, in fresh processes, its executables made anew: what the ranks
kept is lost with them, as when a Horovod job fails. :meth:`run_remote` returns one
``ray.ObjectRef`` per rank at once. Horovod's ``ray_logger.log`` is :func:`ddl.ray.log`:
what rank 0 logs during a call reaches every callback given to ``run``/``execute`` on
the driver, in order (see :mod:`ddl.ray._actor` for the channel).

Failure: if any rank fails, or an actor dies, :meth:`run` raises :class:`ddl.RunError`
naming the rank whose failure came first; the others end with named errors within the
liveness timeout. An actor that died cannot be replaced: start a new executor. Needs
``pip install 'ddl-train[ray]'`` (ray, cryptography).

:class:`ElasticRayExecutor` (:mod:`ddl.ray._elastic`) runs elastic jobs: workers come and
go with the cluster's nodes, each an actor of the same kind, the secret sealed the same way.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl import RunError
from ddl._client_api import engine_ranks
from ddl.ray._actor import (ElasticSettings, Settings, _callbacks, _derive, _seal,  # noqa: F401
                           _Worker, create_settings, log)
from ddl.ray._elastic import ElasticRayExecutor

__all__ = ["RayExecutor", "ElasticRayExecutor", "RunError", "log"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
END_S = 30.0  # how long ending a job, or asking whether its ranks are up, may take


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
        self._running = False  # whether the actors' ranks were started (and not ended)
        self._stopped: List[int] = []  # ranks whose actors _rows stopped (frozen ranks)
        self._publics: List[bytes] = []
        self.nodes: List[str] = []  # each rank's node address, after start()
        self.pids: List[int] = []  # each rank's actor pid, after start()
        self.node_ids: List[str] = []  # each rank's Ray node, after start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence] = None,
              executable_kwargs: Optional[Mapping[str, Any]] = None,
              extra_env_vars: Optional[Mapping[str, str]] = None) -> None:
        """Reserve the placement group, start the actors (raises RuntimeError if the
        resources do not come within ``placement_group_timeout_s``) and the job, as
        Horovod's: each rank makes an ``executable_cls(*executable_args,
        **executable_kwargs)`` that :meth:`execute` hands ``fn``; ``extra_env_vars`` join
        the ranks' environment. :class:`ddl.RunError` if a rank fails to start or to make
        its executable (the actors are then stopped)."""
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
        try:
            hellos = ray.get([a.hello.remote() for a in self._actors],
                             timeout=self.settings.placement_group_timeout_s)
            self.nodes = [h[0] for h in hellos]
            self._publics = [h[1] for h in hellos]
            self.pids = [h[2] for h in hellos]
            self.node_ids = [h[3] for h in hellos]
            self._begin("RayExecutor.start")
        except BaseException:
            self.shutdown()
            raise

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
        """End the job (each rank leaves it as at a program's end, within
        :data:`END_S`), stop the actors and release the placement group start() made
        (safe to call twice)."""
        import ray
        from ray.util.placement_group import remove_placement_group
        self._end_job()
        for a in self._actors:
            ray.kill(a, no_restart=True)
        self._actors, self._stopped = [], []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    # -- the job -----------------------------------------------------------------------------
    def _begin(self, who: str) -> None:
        """Start a new job on every actor (a fresh rank process each, with a fresh
        secret sealed per actor), then make the executables; RunError (the job ended)
        if a rank fails to."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        size, secret = len(self._actors), secrets.token_hex(32)
        try:
            port = ray.get(self._actors[0].free_port.remote(), timeout=END_S)
        except GetTimeoutError:
            raise RuntimeError(f"{who}: the actor of rank 0 is still busy after {END_S:g} s "
                               f"with an earlier call; wait for it first") from None
        except RayError as exc:
            raise RunError(f"{who}: the Ray actor of rank 0 died ({type(exc).__name__}); "
                           f"start a new RayExecutor", rank=0, exitcode=1) from None
        host = self.nodes[0]
        rendezvous = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        refs = [a.begin.remote(size, rendezvous, _seal(secret, self._publics[r], r),
                               self.settings.timeout_s, self.env)
                for r, a in enumerate(self._actors)]
        self._running = True
        self._settle(who, [self._row(rank, ref) for rank, ref in enumerate(refs)])
        if self._executable is not None:
            self._call_all(who, _make_executable, self._executable)

    def _ensure_job(self, who: str) -> None:
        """A job whose every rank is up: the one running, or a new one if a rank of it
        ended (a call failed, or shut ddl down)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        if not self._actors:
            raise RuntimeError(f"{who}: call start() first")
        if self._stopped:
            raise RunError(f"{who}: the Ray actor of rank {self._stopped[0]} was stopped "
                           f"(its rank was frozen); start a new RayExecutor",
                           rank=self._stopped[0], exitcode=1)
        if self._running:
            up = []
            for rank, ref in enumerate([a.alive.remote() for a in self._actors]):
                try:   # asked of all at once: END_S in all at the most
                    up.append(ray.get(ref, timeout=END_S))
                except GetTimeoutError:
                    raise RuntimeError(
                        f"{who}: the actors are still busy after {END_S:g} s with an earlier "
                        f"call (a run_remote whose references have not all resolved?); "
                        f"wait for it first") from None
                except RayError as exc:
                    raise RunError(f"{who}: the Ray actor of rank {rank} died "
                                   f"({type(exc).__name__}); start a new RayExecutor",
                                   rank=rank, exitcode=1) from None
            if all(up):
                return
            self._end_job()
        self._begin(who)

    def _end_job(self) -> None:
        """End every rank of the job (best effort: an actor that died is skipped)."""
        import ray
        from ray.exceptions import RayError
        if not self._running:
            return
        self._running = False
        refs = [a.end.remote() for a in self._actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=END_S)  # one deadline for all
        for ref in done:
            try:
                ray.get(ref)
            except RayError:
                pass  # its actor is gone (the others are killed with their ranks)

    def _settle(self, who: str, rows: Sequence[engine_ranks.Row]) -> List[Any]:
        """The results of ``rows``; after a failure, the job ends and RunError names it."""
        try:
            return engine_ranks.results(rows, len(rows), who)
        except RunError:
            self._end_job()
            raise

    def _call_all(self, who: str, fn: Callable, args: Optional[Sequence] = None,
                  kwargs: Optional[Mapping[str, Any]] = None,
                  callbacks: Optional[Sequence[Callable[[Any], Any]]] = None,
                  actors: Optional[Sequence[Any]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank of the job (or those of ``actors``),
        each value rank 0 logs handed to ``callbacks``: the results in rank order."""
        actors = self._actors if actors is None else actors
        pump = _callbacks(callbacks)
        try:
            payload = engine_ranks.pickle_call(fn, tuple(args or ()), kwargs)
            refs = [a.call.remote(payload, pump.queue if pump else None) for a in actors]
            rows = self._rows(refs, actors)
        finally:
            if pump is not None:
                pump.close()
        results = self._settle(who, rows)
        if pump is not None:
            pump.check()
        return results

    def _rows(self, refs: Sequence[Any], actors: Sequence[Any]) -> List[engine_ranks.Row]:
        """Every rank's row, in rank order. Once a rank has failed, the others get END_S
        to answer (they fail at once when they depend on it); one still running then is
        frozen (its peers have failed around it): its actor is stopped, with its rank,
        and its row says so, so that the call raises instead of waiting for it."""
        import ray
        rows: Dict[int, engine_ranks.Row] = {}
        pending = {ref: rank for rank, ref in enumerate(refs)}
        deadline: Optional[float] = None
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                break
            for ref in ready:
                rank = pending.pop(ref)
                rows[rank] = row = self._row(rank, ref)
                if (row[1] or row[3]) and deadline is None:
                    deadline = time.monotonic() + END_S
        for rank in pending.values():
            ray.kill(actors[rank], no_restart=True)
            self._stopped.append(rank)
            rows[rank] = (rank, -9, None, f"rank {rank} was still running {END_S:g} s after "
                                          f"another rank failed (frozen?); its Ray actor was "
                                          f"stopped: start a new RayExecutor")
        return [rows[rank] for rank in range(len(refs))]

    # -- calls -------------------------------------------------------------------------------
    def run(self, fn: Callable, args: Optional[Sequence] = None,
            kwargs: Optional[Mapping[str, Any]] = None,
            callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank (in the processes of the job
        :meth:`start` began, see the module doc); the results in rank order, or
        :class:`ddl.RunError` naming the rank that failed first. ``callbacks``, as
        Horovod's: each is called here with every value rank 0 sends with
        :func:`ddl.ray.log`, in order, while ``fn`` runs; the first exception a callback
        raises stops them and is raised once ``fn`` ended everywhere."""
        self._ensure_job("RayExecutor.run")
        return self._call_all("RayExecutor.run", fn, args, kwargs, callbacks)

    def run_remote(self, fn: Callable, args: Optional[Sequence] = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> List[Any]:
        """Horovod's ``run_remote``: start ``fn(*args, **kwargs)`` on every rank and
        return at once one ``ray.ObjectRef`` per rank, in rank order; ``ray.get`` of a
        reference gives that rank's result, or raises (a RayTaskError that is a
        :class:`ddl.RunError`) naming the rank and its error. Make no other call on this
        executor before every reference resolved."""
        self._ensure_job("RayExecutor.run_remote")
        payload = engine_ranks.pickle_call(fn, tuple(args or ()), kwargs)
        return [a.call_result.remote(payload) for a in self._actors]

    @staticmethod
    def _row(rank: int, ref: Any) -> engine_ranks.Row:
        """Rank ``rank``'s row, or one that says its actor died."""
        import ray
        from ray.exceptions import RayError, RayTaskError
        try:
            return ray.get(ref)
        except RayTaskError as exc:  # the actor's method raised (not the rank's function)
            cause = getattr(exc, "cause", None) or exc
            return rank, 1, None, (f"the Ray actor of rank {rank} raised "
                                   f"{type(cause).__name__}: {cause}")
        except RayError as exc:  # the actor died (killed, its node lost)
            return rank, -9, None, f"the Ray actor of rank {rank} died: {type(exc).__name__}"

    def execute(self, fn: Callable[..., Any],
                callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """Horovod's ``execute``: ``fn(executable)`` on every rank, ``executable`` being
        the rank's instance of :meth:`start`'s ``executable_cls`` (None without one),
        the same from one call to the next; a ``fn`` that takes no argument is called
        as ``fn()``. The results in rank order; ``callbacks`` as :meth:`run`'s."""
        return self.run(_execute, (fn, _takes_an_argument(fn)), callbacks=callbacks)

    def execute_single(self, fn: Callable[..., Any]) -> Any:
        """Horovod's ``execute_single``: :meth:`execute` on rank 0 alone (the other
        ranks idle; ``fn`` must not wait for them in a collective); its result."""
        self._ensure_job("RayExecutor.execute_single")
        return self._call_all("RayExecutor.execute_single", _execute,
                              (fn, _takes_an_argument(fn)), actors=self._actors[:1])[0]

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


_EXECUTABLE: List[Any] = [None]  # in a rank's process: its executable_cls instance


def _make_executable(cls: type, args: Sequence, kwargs: Mapping[str, Any]) -> None:
    """What :meth:`RayExecutor.start` runs on each rank with an ``executable_cls``."""
    _EXECUTABLE[0] = cls(*args, **kwargs)


def _execute(fn: Callable, with_argument: bool) -> Any:
    """What :meth:`RayExecutor.execute` runs on each rank."""
    return fn(_EXECUTABLE[0]) if with_argument else fn()
