"""``ddl.jax.elastic``: elastic training with JAX: everything of :mod:`ddl.elastic`, and
:class:`JaxState`.

Example::

    import ddl.jax as ddl
    ddl.init()
    state = ddl.elastic.JaxState(params=params, opt_state=tx.init(params), step=0)

    @ddl.elastic.run
    def train(state):
        while state.step < steps:
            state.params, state.opt_state = update(state.params, state.opt_state, batch)
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict

import jax
import numpy as np

from ddl._client_api import raising_ddl_errors
from ddl.elastic import HostsUpdatedInterrupt, NotEnoughRanksError, ObjectState, State
from ddl.elastic import run as _run

from ddl.jax._training import _nnx, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "JaxState", "HostsUpdatedInterrupt",
           "NotEnoughRanksError"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`ddl.elastic.run` for JAX: a collective that fails inside ``jax.jit`` reaches
    the caller as a ``jax.errors.JaxRuntimeError``; this raises the ddl error it carries
    instead (``PeerLostError``...), so that the elastic loop recognises a lost worker."""
    return _run(raising_ddl_errors(func, jax.errors.JaxRuntimeError))


def _copy_leaf(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return leaf  # immutable: a reference is a copy
    if isinstance(leaf, np.ndarray):
        return np.array(leaf, copy=True)
    return copy.deepcopy(leaf)


def _copy_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(_copy_leaf, tree)


def _graph_node(value: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(value)


class JaxState(State):
    """Pytrees as attributes: ``JaxState(params=params, opt_state=opt_state, step=0)``;
    ``state.params = new_params`` (JAX arrays are immutable, so a training step assigns
    new trees to the attributes). A flax ``nnx`` object (a Module, an ``nnx.Optimizer``)
    may be a value too; it is updated in place.

    - ``save()``: keeps each tree (JAX arrays by reference, since nothing can change them;
      NumPy arrays and other leaves copied); an ``nnx`` object's ``nnx.state``.
    - ``restore()``: puts the saved trees back (copies of the NumPy leaves, so that the
      saved ones stay intact); ``nnx.update`` for ``nnx`` objects.
    - ``sync()``: a collective: every array leaf and Python number of every tree takes
      rank 0's value (:func:`ddl.jax.broadcast_parameters`; leaves of other types stay
      as they are); then it saves. Every rank must hold trees of the same structure,
      shapes and dtypes under the same names.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._set_values(kwargs)
        self._saved: Dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        self._saved = {}
        for name in self._names:
            value = getattr(self, name)
            if _graph_node(value):
                self._saved[name] = _copy_tree(_nnx().state(value))
            else:
                self._saved[name] = _copy_tree(value)

    def restore(self) -> None:
        for name in self._names:
            value = getattr(self, name)
            if _graph_node(value):
                _nnx().update(value, _copy_tree(self._saved[name]))
            else:
                setattr(self, name, _copy_tree(self._saved[name]))

    def sync(self) -> None:
        for name in self._names:
            setattr(self, name, broadcast_parameters(getattr(self, name), 0,
                                                     name=f"ddl.elastic.JaxState/{name}"))
        self.save()
