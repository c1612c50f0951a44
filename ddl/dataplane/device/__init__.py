"""The device data plane: collectives on GPU memory, end to end (docs/gpu.md).

* :mod:`.cuda` is the one door to CuPy, the device library: device array views of the
  frameworks' tensors, the data plane's streams and events, results, and the
  conversions bfloat16 needs (CuPy has no bfloat16 dtype).
* :mod:`.ipc_group` is a group of ranks whose GPUs map each other's memory: every
  member's device slots, opened through CUDA IPC, with the rounds of a host
  shared-memory group.
* :mod:`.collectives` runs the collectives on such a group.

Nothing here is imported by ``import ddl``; CuPy itself is imported only once a device
array reaches a collective.
"""
