"""The backend interface: how one collective's packed buffers move among its members.

The executor (:mod:`ddl.runtime.execute`) packs a response's tensors into flat buffers,
asks :func:`ddl.dataplane.backends.pick` for the first backend of
:data:`ddl.dataplane.backends.ORDER` whose :meth:`Backend.supports` accepts the call,
runs the collective on it and unpacks. That list is the only place where a data path is
chosen; the executor never names one.

Adding a backend (CUDA IPC, NCCL, ...) is one new module with a :class:`Backend` subclass
plus one entry in :data:`ddl.dataplane.backends.ORDER`. Its contract:

* **Construction.** ``cls(plane)``, with the rank's :class:`DataPlane` (rank, config,
  TCP transport, shared-memory groups, hosts). Nothing may block or connect here: the
  backend is built on every rank at ``init()``, whether or not it is ever used.
* **Selection.** ``supports(op, group, nbytes)`` must give the same answer on every
  member of ``group`` for the same call (decide from the group, the sizes, the hosts and
  the configuration, never from local timing or load), and must not block. It may raise
  :class:`~ddl.ConfigError` when the configuration forces this backend where it cannot
  run (as ``DDL_TRANSPORT=shm`` across hosts does). ``op`` is a
  ``ddl.v1.coordinator_pb2`` op (``ALLREDUCE``, ``ALLGATHER``, ``BROADCAST``,
  ``ALLTOALL``, ``REDUCESCATTER``); ``nbytes`` the bytes of the result buffer.
* **Buffers.** 1-D, C-contiguous NumPy arrays in host memory (CuPy arrays on the
  current device for a backend whose ``memory`` is ``"cuda"``). Reductions get a buffer
  of the *wire* dtype (:mod:`ddl.core.reduction`: bfloat16 travels as float32, Average is a
  Sum of inputs the executor prepared) and a :class:`~ddl.ReduceOp` value; every other
  collective gets uint8 buffers and byte counts per member, in ``group`` member order.
  Results are written in place; inputs (``src``, ``send``) are never written.
* **Results.** Bitwise equal on every member: a reduction combines the members'
  contributions in one fixed order on every rank (or computes each element on one rank
  and copies it), so that every rank's model stays identical.
* **Deadlines and errors.** Every collective takes a ``deadline``
  (``time.monotonic()`` value) and raises :class:`~ddl.DDLTimeoutError` past it; it
  polls the job's abort check (the transports' ``abort_check``) at least every 200 ms,
  so a fatal job error interrupts it. A lost peer raises :class:`~ddl.PeerLostError`
  naming it, mismatched arguments :class:`~ddl.MismatchError`; a backend that fails
  part-way must make every other member fail too (within seconds), never hang them.
* **Timeline.** ``name`` is the ``transport`` the Timeline records and
  :meth:`Backend.algorithm` the ``algorithm``.
* **Lifetime.** ``close()`` releases what the backend opened (idempotent); the
  transports and shared-memory groups of the :class:`DataPlane` are closed by their
  owner, the runtime.
* **The response cache's cycles** (optional, :mod:`ddl.runtime.cycles`). A backend that
  can run the cycles' vote rounds among every rank of the job implements
  :meth:`Backend.cycle_channel`; the first of ``ORDER`` that returns a channel carries
  them, so this list also chooses the cycles' data path. It decides as ``supports`` does
  (the same on every rank) and returns None where it cannot.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ddl.dataplane.transports.base import AbortCheck, Group, Transport


@dataclass
class DataPlane:
    """What the backends of one executor share: this rank, the configuration, the TCP
    transport (connections to every rank), the shared-memory groups of this host
    (:class:`ddl.dataplane.backends.shm.ShmGroups`, or a
    :class:`ddl.dataplane.backends.shm.FixedShmGroup` for the cache cycles' one group)
    and every rank's host name. ``device_plans``: each group's device plan
    (:class:`~ddl.dataplane.backends.device_plan.DevicePlan`, by member ranks), agreed in
    its first device collective; the device backends decide from it. ``abort_check``:
    the job's abort check for this executor (the cycles' one adds their own stalls), for
    the waits that no transport makes (NCCL's)."""

    rank: int
    config: object
    transport: Transport
    shm_groups: object
    hosts: Mapping[int, str]
    device_plans: dict = field(default_factory=dict)
    abort_check: AbortCheck = field(default=lambda: None)


@dataclass
class CycleSetup:
    """What a backend gets to carry the response cache's cycles among ``world`` (every
    rank of the job): the cache's ``capacity`` (slots), the job's identity and secret,
    this host's name, the cycles' abort check, the cycles' own TCP ``transport``
    (listening, or None when none was opened) with every rank's listener ``addresses``
    ("" where a rank opened none), the ``deadline`` for connecting, and ``on_phase``, which
    names what start-up is doing now (for the errors of ``ddl.init()``)."""

    world: Group
    capacity: int
    job_id: str
    secret: bytes
    hostname: str
    abort_check: AbortCheck
    transport: Optional[Transport]
    addresses: Mapping[int, str]
    deadline: float
    on_phase: Callable[[str], None]


@dataclass
class CycleChannel:
    """A backend's channel for the cycles. ``votes`` runs one round
    (``exchange(vote, inline, deadline, lone=None)``, ``abandon()``, ``inline``,
    ``outcome``, and the lone place: ``lone_fits(call)``, ``lone``, ``lone_shares(call)``
    and ``lone_at`` where ``inline``);
    ``plane`` is where the cycles' own collectives run (through the same backends);
    ``uses_transport``: the channel runs on :attr:`CycleSetup.transport` (else its owner
    may close it); ``close`` releases what the channel opened."""

    votes: Any
    plane: DataPlane
    uses_transport: bool
    close: Callable[[], None]


class Backend(abc.ABC):
    """One data path for collectives (see the module doc for the contract)."""

    name: str = "abstract"  # the Timeline's "transport"
    memory: str = ""        # where its buffers live: "" host (NumPy), "cuda" (CuPy)

    def __init__(self, plane: DataPlane):
        self.plane = plane
        self.config = plane.config

    @abc.abstractmethod
    def supports(self, op: int, group: Group, nbytes: int) -> bool:
        """Whether this backend carries ``op`` among ``group`` for ``nbytes``; the same
        answer on every member."""

    def algorithm(self, op: int, group: Group, nbytes: int, deadline: float) -> str:
        """The algorithm name the Timeline records for this call."""
        return self.name

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: int, group: Group, deadline: float,
                  src: Optional[np.ndarray] = None) -> None:
        """Reduce ``buf`` in place with ``op``. With ``src`` (same dtype and length), this
        rank's contribution is read from ``src`` and ``buf`` is only written."""

    @abc.abstractmethod
    def allgatherv(self, send: np.ndarray, out: np.ndarray, counts: Sequence[int],
                   group: Group, deadline: float) -> None:
        """Every member's ``send`` bytes into ``out``, in member order (``counts``: bytes
        per member)."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root_index: int, group: Group,
                  deadline: float, src: Optional[np.ndarray] = None) -> None:
        """Member ``root_index``'s ``buf`` into every member's ``buf``. With ``src`` (the
        root only, ``buf``'s byte length), the root's bytes are read from ``src`` and
        its ``buf`` is only written."""

    @abc.abstractmethod
    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                  recv_counts: Sequence[int], group: Group, deadline: float) -> None:
        """Block j of ``send`` to member j; member j's block for this rank into ``recv``
        at block j (counts in bytes, member order)."""

    @abc.abstractmethod
    def reducescatter(self, buf: Optional[np.ndarray], counts: Sequence[int], op: int,
                      group: Group, deadline: float, src: Optional[np.ndarray] = None,
                      out: Optional[np.ndarray] = None,
                      pack: Optional[Callable[[Any, Any], None]] = None) -> None:
        """Reduce ``buf`` with ``op``; at least this rank's block (``counts``: elements
        per member) holds the result. With ``src`` (``buf``'s dtype and length) this
        rank's input is read from ``src`` and ``buf`` is scratch, or None (a backend
        that needs scratch makes its own), and with ``pack(piece, dst)`` as well, an
        elementwise map (a prescaling), ``src``'s elements are packed on the way; with
        ``out`` (its block's length) its block of the result goes there
        (:func:`staged_reducescatter` for backends that reduce in a buffer of their own
        only)."""

    def cycle_channel(self, setup: CycleSetup) -> Optional[CycleChannel]:
        """The response cache's cycles on this data path, or None when this backend does
        not carry them among ``setup.world`` (the same answer on every rank)."""
        return None

    def close(self) -> None:
        """Release what this backend opened (idempotent)."""


def staged_reducescatter(run: Callable[[Any], None], buf: Any, counts: Sequence[int],
                         group: Group, src: Any = None, out: Any = None,
                         pack: Optional[Callable[[Any, Any], None]] = None) -> None:
    """:meth:`Backend.reducescatter` for a backend whose ``run(buf)`` reduces in ``buf``
    only: ``src`` copied (or packed) into ``buf`` (or a buffer of its own) first, this
    rank's block into ``out`` after (host or device arrays)."""
    if src is not None:
        if buf is None:
            buf = src.copy() if pack is None else np.empty_like(src)   # (or CuPy's)
        if pack is not None:
            pack(src, buf)
        elif buf is not src:
            buf[...] = src
    run(buf)
    if out is not None:
        start = sum(counts[:group.index])
        out[...] = buf[start:start + counts[group.index]]
