"""PyTorch Lightning on ddl: ``Trainer(strategy=DDLStrategy())`` under ``ddlrun``.

Lightning 2.0 removed its Horovod strategy (``strategy="horovod"``); this is its
successor. Every process ``ddlrun`` (or ``mpirun``, ``torchrun``, a cluster engine)
starts runs the same script, which builds its own ``Trainer``::

    import lightning.pytorch as pl
    from ddl.torch.lightning import DDLStrategy

    trainer = pl.Trainer(strategy=DDLStrategy(), max_epochs=5)   # or strategy="ddl"
    trainer.fit(model, datamodule)

then ``ddlrun -np 4 python train.py``. What the strategy does, so that the script stays
a single-process one:

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

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.fabric.utilities.rank_zero import rank_zero_only as _fabric_rank_zero
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as _pl_rank_zero
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ddl.torch.lightning needs PyTorch Lightning 2: pip install "
                      "'lightning>=2.1'") from exc

import torch

import ddl.torch as _hvd

__all__ = ["DDLStrategy", "DDLEnvironment"]


class DDLEnvironment(ClusterEnvironment):
    """Lightning's view of a ddl job: ranks and sizes are ddl's, and the processes come
    from outside (``ddlrun``, MPI, torchrun, an engine); Lightning starts none."""

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


class DDLStrategy(ParallelStrategy):
    """Data-parallel training over ddl's collectives (see the module doc).

    ``compression`` and ``groups`` are passed to :func:`ddl.torch.DistributedOptimizer`
    (which averages: ``op=Average``).
    """

    strategy_name = "ddl"

    def __init__(self, accelerator=None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io=None, precision_plugin=None, *,
                 compression=_hvd.Compression.none, groups=None) -> None:
        if not _hvd.is_initialized():
            _hvd.init()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=DDLEnvironment(), checkpoint_io=checkpoint_io,
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
        _pl_rank_zero.rank = _fabric_rank_zero.rank = _hvd.rank()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- fitting ---------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        if self._layer_sync is not None:
            raise ValueError("DDLStrategy: Trainer(sync_batchnorm=True) converts to torch's "
                             "SyncBatchNorm, which needs torch.distributed; convert the "
                             "model with ddl.torch.SyncBatchNorm.convert_sync_batchnorm("
                             "model) before fit() instead")
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
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
        super(ParallelStrategy, self).teardown()   # no cluster to tear down: ddl's stays

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="data-parallel training over ddl")


if DDLStrategy.strategy_name not in StrategyRegistry:
    DDLStrategy.register_strategies(StrategyRegistry)
