"""``ddl.torch.elastic``: elastic training with PyTorch (Horovod's ``horovod.torch.elastic``).

Everything of :mod:`ddl.elastic` (``run``, ``State``, ``ObjectState``,
``HostsUpdatedInterrupt``, ``NotEnoughRanksError``), plus :class:`TorchState` and
:class:`ElasticSampler`::

    import ddl.torch as ddl
    ddl.init()
    sampler = ddl.elastic.ElasticSampler(dataset)
    state = ddl.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([lambda: set_lr(optimizer, base_lr * ddl.size())])

    @ddl.elastic.run
    def train(state):
        ...                              # state.model, state.epoch, state.commit()

    train(state)
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Dict

import torch

import ddl
from ddl.elastic import (HostsUpdatedInterrupt, NotEnoughRanksError, ObjectState, State,
                         run)

from ddl.torch import _sampler
from ddl.torch._sampler import ElasticSampler
from ddl.torch._state import broadcast_optimizer_state, broadcast_parameters

# Horovod's horovod.torch.elastic is a package: its modules' paths import here too
# (``from ddl.torch.elastic.sampler import ElasticSampler``, ``...state import TorchState``)
sys.modules[f"{__name__}.sampler"] = _sampler
sys.modules[f"{__name__}.state"] = sys.modules[__name__]

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt", "NotEnoughRanksError"]


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


class TorchState(State):
    """A model, an optimizer and any other values (``epoch=0``, ``sampler=sampler``,
    an LR scheduler...), reachable as attributes (``state.model``, ``state.epoch``; assign
    them to change what the next commit saves).

    - ``save()`` (at ``commit()``, and once here): a deep copy, on the tensors' own
      devices, of the model's and the optimizer's ``state_dict()``, of the
      ``state_dict()`` of every value that has ``state_dict``/``load_state_dict`` (the
      sampler, a scheduler), and of every other value.
    - ``restore()`` (after a failure, on each survivor): loads those copies back (copies
      of them: the saved state stays intact for the next rollback).
    - ``sync()`` (a collective, at the start of ``run`` and after every change of
      workers): every rank takes rank 0's parameters and buffers, optimizer state and
      hyperparameters (:func:`ddl.torch.broadcast_parameters`,
      :func:`~ddl.torch.broadcast_optimizer_state`), each stateful value's
      ``state_dict()`` and the other values (pickled, :func:`ddl.broadcast_object`),
      an :class:`ElasticSampler`'s processed indices too (plus those each rank recorded
      itself: :meth:`ElasticSampler.sync`). Then it saves, so that rolling back never
      undoes a sync.
    - ``reset()`` (after a change of workers, before the reset callbacks): every
      :class:`ElasticSampler` re-shards its remaining indices over the new world.

    Every rank must hold the same kinds of values under the same names, and a model and
    optimizer of the same structure (the broadcasts check shapes and names).
    """

    def __init__(self, model: torch.nn.Module = None,
                 optimizer: torch.optim.Optimizer = None, **kwargs: Any) -> None:
        super().__init__()
        values = dict(kwargs)
        if model is not None:
            values["model"] = model
        if optimizer is not None:
            values["optimizer"] = optimizer
        self._set_values(values)
        self._saved: Dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        self._saved = {}
        for name in self._names:
            value = getattr(self, name)
            self._saved[name] = copy.deepcopy(value.state_dict() if _stateful(value)
                                              else value)

    def restore(self) -> None:
        for name in self._names:
            saved = copy.deepcopy(self._saved[name])
            value = getattr(self, name)
            if _stateful(value):
                value.load_state_dict(saved)
            else:
                setattr(self, name, saved)

    def sync(self) -> None:
        plain = {}
        for name in self._names:
            value = getattr(self, name)
            key = f"ddl.elastic.TorchState/{name}"
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), 0, name=key)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, 0, name=key)
            elif isinstance(value, ElasticSampler):
                value.sync()
            elif _stateful(value):
                value.load_state_dict(ddl.broadcast_object(
                    value.state_dict() if ddl.rank() == 0 else None, 0, name=key))
            else:
                plain[name] = value
        if plain:
            plain = ddl.broadcast_object(plain if ddl.rank() == 0 else None, 0,
                                         name="ddl.elastic.TorchState/values")
            for name, value in plain.items():
                setattr(self, name, value)
        self.save()

    def reset(self) -> None:
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, ElasticSampler):
                value.reset()
