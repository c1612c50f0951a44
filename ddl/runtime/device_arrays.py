"""The device data plane's arrays for the public face and the framework clients (which
may not reach into the data plane): :mod:`ddl.dataplane.device.cuda`, re-exported, and
whether NCCL loads (:func:`ddl.dataplane.device.nccl.available`)."""

from ddl.dataplane.device.cuda import (DeviceArray, available, cupy, device_info, hand_over,
                                       storage_dtype, stream, wrap_input)
from ddl.dataplane.device.nccl import available as nccl_available

__all__ = ["DeviceArray", "available", "cupy", "device_info", "hand_over", "nccl_available",
           "storage_dtype", "stream", "wrap_input"]
