"""The stand-in's per-thread current device and stream stack (CuPy keeps both per thread)."""

import threading

local = threading.local()


def device() -> int:
    return getattr(local, "device", 0)


def streams() -> list:
    found = getattr(local, "streams", None)
    if found is None:
        found = local.streams = []
    return found
