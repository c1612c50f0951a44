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
* when fitting, rank 0's parameters and optimizer state are broadcast to every rank, and
  each optimizer becomes a :func:`ddl.torch.DistributedOptimizer` (gradients allreduced
  as the backward pass produces them, averaged; ``accumulate_grad_batches=k`` reduces on
  every k-th pass only);
* the reductions Lightning asks for (``self.log(..., sync_dist=True)``, early stopping's
  and checkpointing's decisions, ``all_gather``, ``broadcast``, ``barrier``) are ddl
  collectives.

Cross-rank contract: every rank builds the same model and optimizers, and runs the same
Trainer calls in the same order (as with Lightning's DDP). Scale the learning rate by
``ddl.size()`` yourself, as with Horovod. Gradient clipping and mixed precision act on
the averaged gradients: the gradients are reduced before Lightning clips or unscales them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
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


class DDLStrategy(ParallelStrategy):
    """Data-parallel training over ddl's collectives (see the module doc).

    ``compression``, ``op`` (``ddl.Average`` or ``ddl.Adasum``) and ``groups`` are passed
    to :func:`ddl.torch.DistributedOptimizer`; ``backward_passes_per_step`` is the
    Trainer's ``accumulate_grad_batches``.
    """

    strategy_name = "ddl"

    def __init__(self, accelerator=None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io=None, precision_plugin=None, *,
                 compression=_hvd.Compression.none, op=_hvd.Average, groups=None) -> None:
        if not _hvd.is_initialized():
            _hvd.init()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=DDLEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._ddl_options = {"compression": compression, "op": op, "groups": groups}
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

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- fitting ---------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        _hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        named = list(module.named_parameters())
        self._ddl_optimizers = []
        for opt in self.optimizers:
            _hvd.broadcast_optimizer_state(opt, root_rank=0)
            self._ddl_optimizers.append(_hvd.DistributedOptimizer(
                opt, named_parameters=named,
                backward_passes_per_step=max(1, int(trainer.accumulate_grad_batches)),
                **self._ddl_options))

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The closure (forward and backward: the hooks start the allreduces) runs, the
        gradients are averaged, and only then does Lightning clip, unscale and step."""
        opt = getattr(optimizer, "_optimizer", optimizer)   # inside a LightningOptimizer
        if not hasattr(opt, "skip_synchronize"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce():
            result = closure()
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
        the shapes must agree. Differentiable: the gradient flows back to this rank's."""
        if group is not None:
            raise ValueError("DDLStrategy.all_gather: groups are not supported")
        gathered = _hvd.allgather(tensor.unsqueeze(0))
        return gathered if sync_grads else gathered.detach()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return _hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        _hvd.barrier()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # the optimizers' hooks already reduce on every accumulate_grad_batches-th pass
        yield None

    def teardown(self) -> None:
        self._ddl_optimizers = []
        super(ParallelStrategy, self).teardown()   # no cluster to tear down: ddl's stays

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="data-parallel training over ddl")


if DDLStrategy.strategy_name not in StrategyRegistry:
    DDLStrategy.register_strategies(StrategyRegistry)
