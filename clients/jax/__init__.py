"""ddl.jax: ddl for JAX, with optax and flax: the Horovod way, the JAX way.

Four changes make a single-process training script distributed::

    import jax, optax, ddl.jax as ddl
    ddl.init()
    tx = ddl.DistributedOptimizer(optax.adam(1e-3 * ddl.size()))
    params = ddl.broadcast_parameters(params, root_rank=0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)   # one allreduce
        return optax.apply_updates(params, updates), opt_state

then ``ddlrun -np 4 python train.py``. Everything in :mod:`ddl` is here too. The
collectives take ``jax.Array``s and pytrees of them and return new ones on the input's
device; they work eagerly and inside ``jax.jit``, ``grad``, ``value_and_grad`` and
``lax.scan`` (as ordered host callbacks), and are differentiable. See
:mod:`ddl.jax._ops` for the contract inside transformations.
"""

from __future__ import annotations

try:
    import jax as _jax  # noqa: F401
    import optax as _optax  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ddl.jax needs JAX and optax (Python >= 3.12): pip install "
                      "'jax>=0.12' 'optax>=0.2.8' (in a ddl checkout: pip install -e "
                      "'.[jax]')") \
        from exc

from ddl import register_adapter
from ddl import _common_api
from ddl._common_api import *  # noqa: F401,F403  (the framework-neutral API, as in ddl)

from ddl.jax._adapter import JaxAdapter
from ddl.jax._compression import Compression
from ddl.jax._ops import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                          grouped_allreduce, grouped_reducescatter, reducescatter)
from ddl.jax._training import (DistributedOptimizer, allreduce_gradients,
                               broadcast_parameters, broadcast_state, fused_allreduce)
from ddl.jax import elastic

register_adapter(JaxAdapter())

__all__ = [
    *_common_api.__all__,
    # collectives on arrays and pytrees
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter",
    # training
    "DistributedOptimizer", "allreduce_gradients", "fused_allreduce", "Compression",
    "broadcast_parameters", "broadcast_state", "elastic",
]
