"""Broadcasting the initial state (parameters, optimizer state) and Python objects.

Cross-rank contract: every rank calls each function with the same ``root_rank`` (and
``name``), and, for parameters, the same names and shapes in the same structure.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import ddl
from ddl import ProcessSet, broadcast_object, global_process_set


def broadcast_parameters(params, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set,
                         name: str = "broadcast_parameters") -> None:
    """Copy ``root_rank``'s values into every rank's tensors, in place.

    ``params``: a ``state_dict()`` (name -> tensor), ``named_parameters()`` ((name,
    tensor) pairs) or a list of tensors (matched by position). All are sent in one
    grouped call. Entries that are not tensors (e.g. in a state dict) are left alone.

    Example::

        ddl.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise TypeError(f"broadcast_parameters takes a state_dict(), named_parameters() or "
                        f"a list of tensors, not {type(params).__name__}")
    else:
        items = list(params)
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            items = list(enumerate(items))
    tensors = [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]
    if not tensors:
        return
    payload = {k: v.detach() for k, v in tensors}
    out = ddl.broadcast(payload, root_rank, name=name, process_set=process_set)
    with torch.no_grad():
        for k, v in tensors:
            if ddl.rank() != root_rank:
                v.copy_(out[k])


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set,
                              name: str = "broadcast_optimizer_state") -> None:
    """Make every rank's optimizer state and hyperparameters equal ``root_rank``'s.

    Works before the state exists (a fresh SGD or Adam has none: every rank then loads
    the root's, empty, state) and with state that only the root has (e.g. loaded from a
    checkpoint). Tensors travel as tensors; the structure around them, as a pickled
    object (see :func:`ddl.broadcast_object`).
    """
    state = optimizer.state_dict() if ddl.rank() == root_rank else None
    tensors: List[torch.Tensor] = []
    skeleton = _skeleton(state, tensors) if state is not None else None
    skeleton = broadcast_object(skeleton, root_rank, name=f"{name}/structure",
                                process_set=process_set)
    specs: List[Dict[str, Any]] = []
    _collect_specs(skeleton, specs)
    if ddl.rank() != root_rank:
        tensors = [torch.empty(s["shape"], dtype=getattr(torch, s["dtype"])) for s in specs]
    if tensors:
        tensors = ddl.broadcast([t.detach().cpu().contiguous() for t in tensors], root_rank,
                                name=f"{name}/tensors", process_set=process_set)
    if ddl.rank() != root_rank:
        optimizer.load_state_dict(_rebuild(skeleton, tensors))


_TENSOR = "__ddl_tensor__"


def _skeleton(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by a spec; the tensors go to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1, "shape": list(obj.shape),
                "dtype": str(obj.dtype).replace("torch.", "")}
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, tensors) for v in obj)
    return obj


def _collect_specs(obj: Any, specs: List[Dict[str, Any]]) -> None:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            specs.append(obj)
            return
        for v in obj.values():
            _collect_specs(v, specs)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_specs(v, specs)


def _rebuild(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, tensors) for v in obj)
    return obj
