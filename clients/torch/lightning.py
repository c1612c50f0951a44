"""PyTorch Lightning on ddl: ``Trainer(strategy=DDLStrategy())`` under ``ddlrun``.

Lightning 2.0 removed its Horovod strategy (``strategy="horovod"``); this is its
successor. Every process ``ddlrun`` (or ``mpirun``, ``torchrun``, a cluster engine)
starts runs the same script, which builds its own ``Trainer``::

    import lightning.pytorch as pl
    from ddl.torch.lightning import DDLStrategy

    trainer = pl.Trainer(strategy=DDLStrategy(), max_epochs=5)   # or strategy="ddl"
    trainer.fit(model, datamodule)

then ``ddlrun -np 4 python train.py``. Lightning 2 is installed under two names,
``lightning.pytorch`` and ``pytorch_lightning`` (Horovod's examples import the latter),
whose Trainers refuse each other's strategies: ``DDLStrategy()`` is made for the one the
script imported last (:func:`lightning_package`), and ``strategy="ddl"`` is registered
with each one imported before this module (or with the installed one). What the strategy
does, so that the script stays a single-process one:

* ranks, sizes and the device (``cuda:<local rank>`` with ``accelerator="gpu"``, else the
  CPU) come from :mod:`ddl` (``ddl.init()`` is called if the script has not);
* Lightning's data loaders get a ``DistributedSampler`` over ``ddl.size()`` replicas, so
  each rank sees its own shard;
* Lightning's rank-zero-only output (loggers, messages) comes from rank 0 alone;
* when fitting, rank 0's parameters and optimizer state are broadcast to every rank, and
  each optimizer becomes a :func:`ddl.torch.DistributedOptimizer`. Automatic
  optimization: the gradients are averaged in the step, those of the backward pass inside
  its closure as that pass produces them, those accumulated before
  (``accumulate_grad_batches``) with them. Manual optimization: each ``manual_backward``
  averages them, as Lightning's DDP does;
* the reductions Lightning asks for (``self.log(..., sync_dist=True)``, early stopping's
  and checkpointing's decisions, ``all_gather``, ``broadcast``, ``barrier``) are ddl
  collectives.

Cross-rank contract: every rank builds the same model and optimizers, and runs the same
Trainer calls in the same order (as with Lightning's DDP). Scale the learning rate by
``ddl.size()`` yourself, as with Horovod. Gradient clipping and mixed precision act on
the averaged gradients: the gradients are reduced before Lightning clips or unscales them.
``Trainer(sync_batchnorm=True)`` is refused: convert the model with
``ddl.torch.SyncBatchNorm.convert_sync_batchnorm(model)`` first.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from abc import ABCMeta
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch

import ddl.torch as _hvd

__all__ = ["DDLStrategy", "DDLEnvironment", "lightning_package"]

# the two names PyTorch Lightning 2 is installed under, and where each keeps Fabric
_PACKAGES = {"lightning": ("lightning.pytorch", "lightning.fabric"),
             "pytorch_lightning": ("pytorch_lightning", "lightning_fabric")}


def lightning_package(obj: Any = None) -> str:
    """Which PyTorch Lightning this process trains with: ``"lightning"`` (``import
    lightning.pytorch``) or ``"pytorch_lightning"`` (the same code under its older name,
    whose classes Lightning does not take for the other's). That of ``obj`` (a
    LightningModule, a callback) when given; else the one imported last; else the one
    installed (``lightning`` first)."""
    if obj is not None:
        for cls in type(obj).__mro__:
            for package, (pytorch, _) in _PACKAGES.items():
                if cls.__module__.startswith(pytorch + "."):
                    return package
    imported = [name for name in sys.modules if name in ("lightning.pytorch",
                                                         "pytorch_lightning")]
    if imported:   # sys.modules keeps the order of import
        return "lightning" if imported[-1] == "lightning.pytorch" else "pytorch_lightning"
    for package in _PACKAGES:
        if importlib.util.find_spec(package) is not None:
            return package
    raise ImportError("ddl.torch.lightning needs PyTorch Lightning 2: pip install "
                      "'lightning>=2.1'")


def lightning_modules(package: str) -> types.SimpleNamespace:
    """What ddl uses of one Lightning package (``"lightning"`` or
    ``"pytorch_lightning"``): ``pl`` (``lightning.pytorch`` or ``pytorch_lightning``),
    and the classes ddl's own derive from."""
    pytorch, fabric = _PACKAGES[package]
    pl = importlib.import_module(pytorch)
    strategies = importlib.import_module(pytorch + ".strategies")
    return types.SimpleNamespace(
        package=package, pl=pl, LightningModule=pl.LightningModule,
        Checkpoint=importlib.import_module(pytorch + ".callbacks").Checkpoint,
        ParallelStrategy=strategies.ParallelStrategy,
        StrategyRegistry=strategies.StrategyRegistry,
        ClusterEnvironment=importlib.import_module(fabric + ".plugins").ClusterEnvironment,
        TrainerFn=importlib.import_module(pytorch + ".trainer.states").TrainerFn,
        rank_zero=[importlib.import_module(pytorch + ".utilities.rank_zero").rank_zero_only,
                   importlib.import_module(fabric + ".utilities.rank_zero").rank_zero_only])


class PerLightningPackage(ABCMeta):
    """The metaclass that makes ``DDLStrategy()`` (and ``DDLEnvironment()``, and a
    subclass of either) an instance of a class made once per Lightning package, whose
    bases are the class and that package's class named by ``_lightning_base``
    (``ParallelStrategy``, ``ClusterEnvironment``), so that either package's Trainer
    takes it; ``isinstance(obj, DDLStrategy)`` holds for both. The made class's
    ``_lightning`` is :func:`lightning_modules` of its package."""

    _made: Dict[tuple, type] = {}

    def __call__(cls, *args: Any, **kwargs: Any):
        made = cls.for_package(lightning_package())
        return ABCMeta.__call__(made, *args, **kwargs)

    def for_package(cls, package: str) -> type:
        """This class for one Lightning package (``"lightning"`` or
        ``"pytorch_lightning"``), made on first use."""
        if getattr(cls, "_lightning", None) is not None:
            return cls
        key = (cls, package)
        if key not in PerLightningPackage._made:
            mods = lightning_modules(package)
            made = PerLightningPackage(cls.__name__, (cls, getattr(mods, cls._lightning_base)),
                               {"_lightning": mods, "__module__": cls.__module__,
                                "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
            PerLightningPackage._made[key] = made
            if cls._lightning_base == "ParallelStrategy" and \
                    cls.strategy_name not in mods.StrategyRegistry:
                made.register_strategies(mods.StrategyRegistry)
        return PerLightningPackage._made[key]


class DDLEnvironment(metaclass=PerLightningPackage):
    """Lightning's view of a ddl job: ranks and sizes are ddl's, and the processes come
    from outside (``ddlrun``, MPI, torchrun, an engine); Lightning starts none."""

    _lightning_base = "ClusterEnvironment"
    _lightning: Optional[types.SimpleNamespace] = None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:   # ddl's own rendezvous; Lightning opens none
        return ""

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return _hvd.is_initialized()

    def world_size(self) -> int:
        return _hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != _hvd.size():
            raise ValueError(f"the world size is ddl's ({_hvd.size()}); Lightning asked "
                             f"for {size}: leave Trainer(devices=..., num_nodes=...) at "
                             f"their defaults under ddlrun")

    def global_rank(self) -> int:
        return _hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != _hvd.rank():
            raise ValueError(f"the rank is ddl's ({_hvd.rank()}); Lightning asked for "
                             f"{rank}")

    def local_rank(self) -> int:
        return _hvd.local_rank()

    def node_rank(self) -> int:
        return _hvd.cross_rank()


_OPS = {"sum": _hvd.Sum, "mean": _hvd.Average, "avg": _hvd.Average,
        "average": _hvd.Average, "min": _hvd.Min, "max": _hvd.Max,
        "product": _hvd.Product}


def _reduce_op(reduce_op: Any):
    """A ddl op from what Lightning passes: None (mean), a name, or torch's ReduceOp."""
    if reduce_op is None:
        return _hvd.Average
    # torch.distributed.ReduceOp.SUM reads "RedOpType.SUM"
    name = str(reduce_op).rsplit(".", 1)[-1].lower()
    if name not in _OPS:
        raise ValueError(f"DDLStrategy.reduce: unsupported reduce_op {reduce_op!r}; use "
                         f"one of {sorted(_OPS)}")
    return _OPS[name]


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class DDLStrategy(metaclass=PerLightningPackage):
    """Data-parallel training over ddl's collectives (see the module doc).

    ``compression`` and ``groups`` are passed to :func:`ddl.torch.DistributedOptimizer`
    (which averages: ``op=Average``).
    """

    strategy_name = "ddl"
    _lightning_base = "ParallelStrategy"
    _lightning: Optional[types.SimpleNamespace] = None

    def __init__(self, accelerator=None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io=None, precision_plugin=None, *,
                 compression=_hvd.Compression.none, groups=None) -> None:
        if not _hvd.is_initialized():
            _hvd.init()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=DDLEnvironment.for_package(
                             self._lightning.package)(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._ddl_options = {"compression": compression, "groups": groups}
        self._ddl_optimizers: List[torch.optim.Optimizer] = []

    # -- where this rank runs -------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:   # Lightning then adds a DistributedSampler
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or []
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", _hvd.local_rank() % torch.cuda.device_count())
        return devices[0] if devices else torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": _hvd.size(), "rank": _hvd.rank()}

    def set_world_ranks(self) -> None:
        """Lightning's rank-zero-only functions (loggers, messages) ask ddl's rank."""
        for rank_zero_only in self._lightning.rank_zero:
            rank_zero_only.rank = _hvd.rank()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- fitting ---------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError("DDLStrategy: Trainer(sync_batchnorm=True) converts to torch's "
                             "SyncBatchNorm, which needs torch.distributed; convert the "
                             "model with ddl.torch.SyncBatchNorm.convert_sync_batchnorm("
                             "model) before fit() instead")
        super().setup(trainer)
        if trainer.state.fn != self._lightning.TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        _hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        named = list(module.named_parameters())
        mine = {id(p) for _, p in named}
        self._ddl_optimizers = []
        for opt in self.optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            if not any(id(p) in mine for p in params):
                continue   # Lightning's stand-in when configure_optimizers returns None
            _hvd.broadcast_optimizer_state(opt, root_rank=0)
            opt = _hvd.DistributedOptimizer(opt, named_parameters=named,
                                            **self._ddl_options)
            # the hooks reduce only in the backward pass of the step's closure (see
            # optimizer_step): gradients accumulated before are reduced by the step
            opt._ddl_paused = True
            self._ddl_optimizers.append(opt)

    def _manual(self) -> bool:
        module = self.lightning_module
        return module is not None and not module.automatic_optimization

    def pre_backward(self, closure_loss) -> None:
        super().pre_backward(closure_loss)
        if self._manual():
            for opt in self._ddl_optimizers:
                opt._ddl_paused = False

    def post_backward(self, closure_loss) -> None:
        """Manual optimization: as with Lightning's DDP, every ``manual_backward`` averages
        the gradients (what was accumulated before is the same on every rank, so it stays),
        so that ``clip_gradients``, an unscale and the step see the average."""
        super().post_backward(closure_loss)
        if self._manual():
            for opt in self._ddl_optimizers:
                opt._ddl_paused = True
                opt.synchronize()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Automatic optimization: the closure (forward and backward: the hooks start the
        allreduces) runs, the gradients are averaged, and only then does Lightning clip,
        unscale and step. Manual: the step takes what ``manual_backward`` averaged."""
        opt = getattr(optimizer, "_optimizer", optimizer)   # inside a LightningOptimizer
        if not hasattr(opt, "skip_synchronize"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._manual():
            with opt.skip_synchronize():
                return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce():
            opt._ddl_paused = False   # this pass's gradients go as backward makes them
            try:
                result = closure()
            finally:
                opt._ddl_paused = True
            opt.synchronize()
            return result

        with opt.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    # -- what Lightning asks of the processes ---------------------------------------------------
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Any = "mean"):
        """Reduce ``tensor`` over every rank (``mean`` by default, as Lightning's DDP);
        anything not a tensor is returned as it is."""
        if group is not None:
            raise ValueError("DDLStrategy.reduce: groups are not supported; use ddl's "
                             "process sets directly")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _hvd.allreduce(tensor, op=_reduce_op(reduce_op))

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None,
                   sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked on a new first dimension (size ``ddl.size()``);
        the shapes must agree. With ``sync_grads``, the gradient of this rank's slice,
        summed over the ranks, flows back to ``tensor`` (as Lightning's DDP)."""
        if group is not None:
            raise ValueError("DDLStrategy.all_gather: groups are not supported")
        if not sync_grads:
            return _hvd.allgather(tensor.detach().unsqueeze(0))
        # Lightning's DDP sums the incoming gradients; ddl's allgather averages them
        return _hvd.allgather(_ScaleGrad.apply(tensor, float(_hvd.size())).unsqueeze(0))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return _hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        _hvd.barrier()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # nothing to block: outside the step's closure the optimizers' hooks are paused,
        # and the step reduces what was accumulated
        yield None

    def teardown(self) -> None:
        for opt in self._ddl_optimizers:   # a later fit's optimizers reduce on their own
            opt._ddl_detach("DistributedOptimizer: the Trainer that made this optimizer "
                            "has finished; it reduces nothing any more")
        self._ddl_optimizers = []
        # no cluster to tear down: ddl's stays
        super(self._lightning.ParallelStrategy, self).teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="data-parallel training over ddl")


# strategy="ddl" for the Lightning packages imported so far, or the one installed
for _package in [p for p, (pytorch, _) in _PACKAGES.items() if pytorch in sys.modules] or \
        [lightning_package()]:
    DDLStrategy.for_package(_package)
del _package
