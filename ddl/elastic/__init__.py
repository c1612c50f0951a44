"""Elastic training: jobs that lose or gain workers keep going from their last commit.

Under ``ddlrun --min-np N --max-np M [--host-discovery-script PATH]``::

    import ddl, ddl.elastic
    ddl.init()
    state = ddl.elastic.ObjectState(epoch=0, weights=w)

    @ddl.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                      # collectives as usual
            state.commit()           # a rollback point; raises HostsUpdatedInterrupt
                                     # on every rank when workers were added

    train(state)

Framework states: ``ddl.torch.elastic.TorchState`` (and ``ElasticSampler``),
``ddl.keras.elastic.KerasState`` (and its callbacks), ``ddl.jax.elastic.JaxState``.
"""

from ddl.core.errors import HostsUpdatedInterrupt, NotEnoughRanksError
from ddl.elastic.run import run
from ddl.elastic.state import ObjectState, State

__all__ = ["run", "State", "ObjectState", "HostsUpdatedInterrupt", "NotEnoughRanksError"]
