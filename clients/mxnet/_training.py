"""Training with MXNet: DistributedTrainer (Gluon), DistributedOptimizer (Module and
custom loops) and broadcast_parameters.

Cross-rank contract: every rank builds the same model and trainer, in the same order,
and steps the same number of times; gradients are averaged over the process set before
each update, so ``size`` ranks at batch ``b`` train like one rank at batch ``size * b``.
"""

from __future__ import annotations

import warnings
from typing import Optional

import mxnet as mx
import numpy as np

from ddl import ProcessSet, ReduceOp, global_process_set
from ddl._client_api import compressions
from ddl.mxnet._ops import allreduce_, broadcast_, grouped_allreduce_


def _reduce_grads(named_grads, prefix: str, predivide: float, num_groups: int,
                  process_set: ProcessSet) -> None:
    """Average every gradient in place (``num_groups`` > 0: that many fused groups). A
    rank outside ``process_set`` keeps its own gradients (it steps alone, as Horovod's)."""
    if process_set.size() == 1 or not process_set.included() or not named_grads:
        return
    kw = dict(op=ReduceOp.Average, prescale_factor=1.0 / predivide,
              postscale_factor=predivide, process_set=process_set)
    if num_groups > 0:
        size = -(-len(named_grads) // num_groups)
        for g in range(0, len(named_grads), size):
            part = named_grads[g:g + size]
            grouped_allreduce_([t for _, t in part], name=f"{prefix}group{g // size}", **kw)
        return
    for name, grad in named_grads:
        allreduce_(grad, name=f"{prefix}{name}", **kw)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """``optimizer`` whose updates use gradients averaged over the process set.

    Every other attribute is the wrapped optimizer's, read and written: what a Gluon
    ``Trainer`` or a ``Module`` sets on it (``rescale_grad`` at each step,
    ``param_dict``, ``idx2name``) reaches the optimizer that does the update.

    Example::

        opt = ddl.mxnet.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.01 * size))
    """

    _OWN = frozenset({"_optimizer", "_predivide", "_num_groups", "_process_set"})

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set):
        self._optimizer = optimizer
        self._predivide = float(gradient_predivide_factor)
        self._num_groups = int(num_groups)
        self._process_set = process_set

    def __getattr__(self, item):
        return getattr(self.__dict__["_optimizer"], item)

    def __setattr__(self, item, value):
        if item in self._OWN:
            object.__setattr__(self, item, value)
        else:
            setattr(self._optimizer, item, value)

    def __getstate__(self):  # Trainer.save_states pickles the optimizer
        return {k: self.__dict__[k] for k in self._OWN}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def _reduce(self, index, grad) -> None:
        indices = index if isinstance(index, (list, tuple)) else [index]
        grads = grad if isinstance(grad, (list, tuple)) else [grad]
        _reduce_grads([(str(i), g) for i, g in zip(indices, grads)],
                      "mxnet.DistributedOptimizer/", self._predivide, self._num_groups,
                      self._process_set)

    def update(self, index, weight, grad, state):
        self._reduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._reduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A Gluon ``Trainer`` that averages gradients over the process set (no kvstore).

    ``prefix`` keeps tensor names unique when one program holds several trainers;
    ``compression`` (``Compression.fp16``) casts gradients for the wire.

    Example::

        trainer = ddl.mxnet.DistributedTrainer(net.collect_params(), "sgd",
                                               {"learning_rate": 0.01 * ddl.mxnet.size()})
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=None,
                 gradient_predivide_factor: float = 1.0, prefix: Optional[str] = None,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set):
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer reduces gradients itself: it uses the optimizer "
                          "inside the DistributedOptimizer given (whose "
                          "gradient_predivide_factor, num_groups and process_set are not "
                          "used; pass them to DistributedTrainer)", stacklevel=2)
            optimizer = optimizer._optimizer
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._ddl_prefix = f"{prefix}." if prefix else ""
        self._ddl_compression = compression
        self._ddl_predivide = float(gradient_predivide_factor)
        self._ddl_num_groups = int(num_groups)
        self._ddl_process_set = process_set

    def _allreduce_grads(self):
        named = []
        for i, param in enumerate(self._params):
            if param.grad_req != "null":
                named.append((f"{i}.{param.name}", param.list_grad()[0]))
        compression = self._ddl_compression
        wires = named if compression is None else [
            (n, compression.compress(g)) for n, g in named]
        _reduce_grads([(n, w if compression is None else w[0]) for n, w in wires],
                      f"{self._ddl_prefix}mxnet.DistributedTrainer/", self._ddl_predivide,
                      self._ddl_num_groups, self._ddl_process_set)
        if compression is not None:
            for (_, g), (_, (w, ctx)) in zip(named, wires):
                g[:] = compression.decompress(w, ctx)


def broadcast_parameters(params, root_rank: int = 0, prefix: Optional[str] = None) -> None:
    """Set every parameter to ``root_rank``'s values, in place.

    ``params``: a dict of name -> NDArray or Gluon ``Parameter`` (e.g.
    ``net.collect_params()``). A parameter whose initialisation is deferred (shape not
    known yet) is broadcast right after it is initialised, at the first forward pass.
    """
    if not hasattr(params, "items"):
        raise TypeError(f"broadcast_parameters takes a dict of name -> NDArray/Parameter, "
                        f"not {type(params).__name__}")
    base = f"{prefix}." if prefix else ""
    for name, p in sorted(params.items()):
        tensor_name = f"{base}broadcast_parameters/{name}"
        if isinstance(p, mx.nd.NDArray):
            broadcast_(p, root_rank, name=tensor_name)
            continue
        if not isinstance(p, mx.gluon.Parameter):
            raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not an NDArray or "
                            f"Gluon Parameter")
        try:
            arrays = p.list_data()
        except mx.gluon.parameter.DeferredInitializationError:
            _broadcast_after_init(p, root_rank, tensor_name)
            continue
        for k, arr in enumerate(arrays):
            broadcast_(arr, root_rank, name=f"{tensor_name}/{k}")


def _broadcast_after_init(p, root_rank: int, tensor_name: str) -> None:
    original = p._finish_deferred_init

    def finish(*args, **kwargs):
        original(*args, **kwargs)
        p._finish_deferred_init = original
        with mx.autograd.pause():  # this runs inside the first forward's record()
            for k, arr in enumerate(p.list_data()):
                broadcast_(arr, root_rank, name=f"{tensor_name}/{k}")
    p._finish_deferred_init = finish


Compression = compressions(lambda t, dtype: t.astype(dtype),
                           lambda t: np.issubdtype(t.dtype, np.floating), fp16=np.float16)
