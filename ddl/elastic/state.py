"""What an elastic job keeps across a change of workers: :class:`State` objects.

Cross-rank contract: every rank calls ``commit()`` (and ``check_host_updates()``) at the
same points of its loop, as a collective: rank 0 asks ddlrun whether workers were added
or released and broadcasts the answer, so that every rank raises
:class:`~ddl.core.errors.HostsUpdatedInterrupt` at the same commit. ``sync()`` is a
collective too: rank 0's state replaces every other rank's (new workers get it that way).
``save()`` and ``restore()`` are local: a commit copies the state in memory, a failure
rolls back to that copy on each survivor; nothing goes to disk.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List

import numpy as np

from ddl._api import broadcast
from ddl._objects import broadcast_object
from ddl.core.errors import HostsUpdatedInterrupt
from ddl.runtime.runtime import topology
from ddl.startup import elastic_link as _link

_NO_CHANGE, _CHANGED, _ONLY_REMOVED = 0, 1, 2


class State:
    """Base class of the elastic states: subclasses implement :meth:`save`,
    :meth:`restore` and :meth:`sync` (and :meth:`reset` when the world's size matters to
    them, e.g. a learning rate scaled by ``size()``)."""

    def __init__(self) -> None:
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called, in order, after every change of workers (on every rank of
        the new world, before ``sync()``): re-add process sets, rescale the learning
        rate, rebuild what depends on ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def _set_values(self, values: Dict[str, Any]) -> None:
        """Keep ``values`` as attributes, their names in ``self._names`` (for states of
        named values); ValueError for names that would hide this class's own."""
        taken = sorted(n for n in values if n.startswith("_") or hasattr(State, n))
        if taken:
            raise ValueError(f"{type(self).__name__}: {taken} cannot be state names (they "
                             f"start with '_' or are State's methods); rename them")
        self._names = list(values)
        for name, value in values.items():
            setattr(self, name, value)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (the point a failure rolls back to), then check for host
        updates: a collective, called by every rank at the same step."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if ddlrun added or
        released workers since this world formed (a collective; no-op outside an
        elastic job)."""
        link, world = _link.current(), _link.world
        if link is None or world is None:
            return
        code = _NO_CHANGE
        if topology().rank == 0:
            reply = link.request({"op": "poll", "version": world.get("version", 0)}, 30.0,
                                 "ddl.elastic: check_host_updates")
            if reply.get("changed"):
                code = _ONLY_REMOVED if reply.get("only_removed") else _CHANGED
        code = int(broadcast(np.array([code], np.int64), 0,
                             name="ddl.elastic.check_host_updates")[0])
        if code != _NO_CHANGE:
            raise HostsUpdatedInterrupt(
                "ddlrun " + ("released workers" if code == _ONLY_REMOVED
                             else "added workers") + " since this world formed",
                skip_sync=code == _ONLY_REMOVED)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a change of workers, before the reset callbacks."""


class ObjectState(State):
    """Plain values (numbers, NumPy arrays, lists, dicts) as attributes:
    ``state = ObjectState(epoch=0, batch=0, weights=w)``; ``state.epoch += 1``. ``save``
    deep-copies them, ``restore`` puts the copy back, ``sync`` broadcasts rank 0's
    (pickled between ranks of this job; see :func:`ddl.broadcast_object`)."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_state: Dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state, 0,
                                                 name="ddl.elastic.ObjectState")
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))
