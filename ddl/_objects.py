"""Python objects across ranks: broadcast and allgather of pickled bytes.

Pickle can run code when it loads, so these are safe only because the bytes come from a
rank of this job: every connection of ddl's data plane is authenticated with the job's
secret, and nothing else can send into it. Do not pass objects you would not unpickle
yourself. Cross-rank contract: every member calls with the same ``root_rank`` and
``name``.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional

import numpy as np

from ddl import _api, _args
from ddl._api import allgather, broadcast
from ddl._process_sets import ProcessSet, global_process_set
from ddl.runtime.runtime import topology
from ddl.v1 import coordinator_pb2 as pb


def _pickled(obj: Any):
    """``(bytes as uint8 array, "")``, or ``(None, why it cannot be pickled)``."""
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8), ""
    except Exception as exc:  # pickling runs user code: any error names the object
        return None, (f"passed an object that cannot be pickled "
                      f"({type(obj).__name__}): {type(exc).__name__}: {exc}")


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every member (the others pass anything, e.g. None);
    pickled on the root, unpickled elsewhere (see the module doc for why that is safe).
    If the root cannot pickle ``obj``, every member raises InvalidRequestError.

    Example::

        config = ddl.broadcast_object(load_config() if ddl.rank() == 0 else None)
    """
    _args.check_name(name)
    name = name or "broadcast_object"
    root = topology().rank == root_rank
    data, problem = _pickled(obj) if root else (None, "")
    if problem:  # every member's first broadcast fails at once, naming this rank
        _api._enqueue(pb.BROADCAST, None, name=f"{name}/size", process_set=process_set,
                      root_rank=root_rank, problem=problem)
    size = broadcast(np.array([len(data) if root else 0], dtype=np.int64), root_rank,
                     name=f"{name}/size", process_set=process_set)
    if not root:
        data = np.empty(int(size[0]), dtype=np.uint8)
    data = broadcast(data, root_rank, name=f"{name}/bytes", process_set=process_set)
    return obj if root else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every member's ``obj``, as a list in rank order (pickled; see the module doc).
    If a member cannot pickle its ``obj``, every member raises InvalidRequestError."""
    _args.check_name(name)
    name = name or "allgather_object"
    data, problem = _pickled(obj)
    if problem:
        _api._enqueue(pb.ALLGATHER, None, name=f"{name}/sizes", process_set=process_set,
                      problem=problem)
    sizes = allgather(np.array([len(data)], dtype=np.int64), name=f"{name}/sizes",
                      process_set=process_set)
    blob = allgather(data, name=f"{name}/bytes", process_set=process_set)
    out, start = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(blob[start:start + size].tobytes()))
        start += size
    return out
