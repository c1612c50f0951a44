"""The device data plane's arrays for the public face and the framework clients (which
may not reach into the data plane): :mod:`ddl.dataplane.device.cuda`, re-exported."""

from ddl.dataplane.device.cuda import (DeviceArray, available, cupy, hand_over, storage_dtype,
                                       stream, wrap_input)

__all__ = ["DeviceArray", "available", "cupy", "hand_over", "storage_dtype", "stream",
           "wrap_input"]
