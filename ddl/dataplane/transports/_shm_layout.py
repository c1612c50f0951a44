"""Where everything lies in a shared-memory group's segment: the header words, each local
rank's lines, flags and message, and the states a rank's line can say.

Every part of :class:`~ddl.dataplane.transports.shm.ShmGroup` reads its offsets from here
(the design note is :mod:`ddl.dataplane.transports.shm`'s).
"""

from __future__ import annotations

import sys

PAGE = 4096

# Segment layout. Header words (u64): 0 magic (written last by the creator), 1 version,
# 2 local_size, 3 data bytes, 4 creator pid, 5 abort (0, or local rank + 1 of the first
# rank that failed); bytes 48..80 the header's MAC. Then, per local rank: a 64-B line with
# its round counter and 3 descriptor words per bank (written by it alone); a 64-B line
# with pid, state, pid namespace, the address of its cross-memory probe and its verdict
# on the others' (_CMA_OK or _CMA_NO); its "sleeping on you" flags (one byte per waiter); a
# message saying why it failed. Then the data: bank 0, bank 1, each one slot per rank.
_MAGIC = int.from_bytes(b"DDLSHM01", "little")
_VERSION = 2
_ABORT = 5
_MAC_AT = 48
_SEQ_AT = 128
_LINE = 64
_MSG_BYTES = 256
_ATTACHED, _CLOSED, _FAILED = 1, 2, 3
_CMA_OK, _CMA_NO = 1, 2
_LOW = 4 if sys.byteorder == "big" else 0   # offset of a counter's low 32-bit word
