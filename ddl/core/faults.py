"""Deterministic fault injection for tests; inert unless ``DDL_TEST_FAULT`` is set.

The library calls :func:`hit` at a few named *points* (a ring step, a TCP transfer, ...)
behind a module-level check, so with the variable unset a point costs one attribute
load and a comparison with ``None``::

    if _faults.ACTIVE is not None: _faults.hit("ring.step")

Spec (read once, at import, from ``DDL_TEST_FAULT``)::

    DDL_TEST_FAULT="rank=2;point=ring.step;after=3;action=sigkill"

Fields, ``;``-separated ``key=value`` (several faults: join specs with ``|``):

``rank``    required. The global rank that acts (``DDL_RANK``; 0 when unset), or ``*``
            for every rank.
``point``   required. One of :data:`POINTS`.
``after``   number of earlier hits to let pass, default 0: the fault acts at the
            ``after + 1``-th time this process reaches the point (0-based index
            ``after``). Hits are counted per process and per point, over all threads.
``action``  required. ``sigkill``, ``sigstop``, ``sigterm``, ``sigint`` (the signal to
            this process), ``abort`` (``os.abort()``), ``exit:CODE`` (``os._exit(CODE)``:
            no ``atexit``, no goodbye), ``sleep:SECONDS`` (blocks the thread that hit the
            point), ``raise`` (raises :class:`FaultInjected`, a ``RuntimeError``, in that
            thread).
``p``       optional probability in (0, 1]: from the ``after``-th hit on, each hit acts
            with probability ``p`` drawn from ``random.Random(seed)``, so the moment is
            random but reproducible (default 1: exactly the ``after``-th hit).
``seed``    optional integer seed for ``p`` (default 0).
``note``    optional file path (without ``;`` or ``|``): before acting, append one line
            ``"<rank> <point> <hit index> <time.monotonic()> <action>"`` to it (the
            monotonic clock is shared by the processes of one Linux host), so a test can
            time what follows.

Each fault acts once. Hooks run in whatever thread reaches the point, usually the
engine's; actions that belong in the main thread (``sys.exit``, an uncaught exception)
are for the test script itself to perform. A malformed spec raises
:class:`~ddl.ConfigError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from ddl.core.errors import ConfigError

ENV = "DDL_TEST_FAULT"

# Named points and where they are.
POINTS: Mapping[str, str] = {
    "device.round": "each round a rank enters on a CUDA IPC group (device collectives), "
                    "once its stream has done the round's work",
    "nccl.call": "each collective a rank hands to an NCCL communicator, before it is "
                 "queued",
    "ring.step": "each step of a ring reduce-scatter or ring allgather (ring allreduce, "
                 "allgather, reducescatter): 2*(n-1) hits per ring allreduce",
    "rd.step": "each exchange of a recursive-doubling allreduce (with a size that is not a "
               "power of two, the ranks that sit the exchanges out never reach it)",
    "broadcast.step": "each send, receive or forwarded chunk of a broadcast",
    "alltoall.step": "each pairwise exchange of an alltoall",
    "shm.step": "each chunk of a shared-memory collective, before its rounds (an "
                "allreduce up to its small size: one per call)",
    "tcp.transfer": "the start of each TCP send, recv_into or sendrecv with bytes to move",
    "tcp.chunk": "each time a TCP transfer moves bytes (a send or recv system call; how "
                 "many bytes each moves depends on the socket buffers)",
    "tcp.dial": "each outgoing data-plane connection, once connected, before its handshake",
    "tcp.accept": "each incoming data-plane connection, once accepted, before its handshake "
                  "(in the acceptor thread)",
    "init.register": "ddl.init(), before the rank registers with its coordinator (the "
                     "others wait for it in the rendezvous)",
    "init.registered": "ddl.init(), once the rendezvous is complete, before the rank opens "
                       "its control stream",
    "shm.attach": "each shared-memory group's attach, before the rank creates or opens the "
                  "segment (the response cache's group in ddl.init(), a collective's on "
                  "first use)",
}

_SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigterm": signal.SIGTERM,
            "sigint": signal.SIGINT}
_FIELDS = ("rank", "point", "after", "action", "p", "seed", "note")


class FaultInjected(RuntimeError):
    """Raised by the ``raise`` action."""


@dataclass
class Fault:
    rank: Optional[int]  # None: every rank
    point: str
    action: str
    after: int = 0
    argument: float = 0.0  # exit code or sleep seconds
    p: float = 1.0
    seed: int = 0
    note: str = ""
    hits: int = 0
    done: bool = False
    rng: random.Random = field(default_factory=random.Random, repr=False)


def _bad(spec: str, key: str, value: str, expected: str) -> ConfigError:
    return ConfigError(f"{ENV}: field '{key}' has a bad value {value!r} in {spec!r}: expected "
                       f"{expected}", variable=ENV, value=spec)


def parse(text: str) -> List[Fault]:
    """Parse a ``DDL_TEST_FAULT`` value; ``ConfigError`` (a ValueError) names the field."""
    faults = []
    for spec in text.split("|"):
        spec = spec.strip()
        if not spec:
            raise ConfigError(f"{ENV}: empty fault spec in {text!r}; expected "
                              f"'rank=R;point=P;action=A[;after=N]'", variable=ENV,
                              value=text)
        fields: Dict[str, str] = {}
        for part in spec.split(";"):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ConfigError(f"{ENV}: '{part}' in {spec!r} is not key=value",
                                  variable=ENV, value=text)
            if key not in _FIELDS:
                raise ConfigError(f"{ENV}: unknown field '{key}' in {spec!r}; fields are "
                                  f"{', '.join(_FIELDS)}", variable=ENV, value=text)
            if key in fields:
                raise ConfigError(f"{ENV}: field '{key}' is given twice in {spec!r}",
                                  variable=ENV, value=text)
            fields[key] = value
        for key in ("rank", "point", "action"):
            if key not in fields:
                raise ConfigError(f"{ENV}: field '{key}' is missing in {spec!r}",
                                  variable=ENV, value=text)
        faults.append(_fault(spec, fields))
    return faults


def _int(spec: str, key: str, value: str, minimum: int) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise _bad(spec, key, value, f"an integer >= {minimum}")
    return n


def _fault(spec: str, fields: Dict[str, str]) -> Fault:
    rank_text = fields["rank"]
    rank = None if rank_text == "*" else _int(spec, "rank", rank_text, 0)
    point = fields["point"]
    if point not in POINTS:
        raise _bad(spec, "point", point, "one of " + ", ".join(POINTS))
    action, _, arg_text = fields["action"].partition(":")
    argument = 0.0
    if action == "exit":
        argument = _int(spec, "action", arg_text, 0) if arg_text.isdigit() else -1
        if not 0 <= argument <= 255:
            raise _bad(spec, "action", fields["action"], "exit:CODE with CODE in 0..255")
    elif action == "sleep":
        try:
            argument = float(arg_text)
        except ValueError:
            argument = -1.0
        if not 0.0 <= argument < float("inf"):
            raise _bad(spec, "action", fields["action"], "sleep:SECONDS with SECONDS >= 0")
    elif (action not in _SIGNALS and action not in ("abort", "raise")) or arg_text:
        raise _bad(spec, "action", fields["action"],
                   "one of sigkill, sigstop, sigterm, sigint, abort, raise, exit:CODE, "
                   "sleep:SECONDS")
    after = _int(spec, "after", fields.get("after", "0"), 0)
    p = 1.0
    if "p" in fields:
        try:
            p = float(fields["p"])
        except ValueError:
            p = -1.0
        if not 0.0 < p <= 1.0:
            raise _bad(spec, "p", fields["p"], "a probability in (0, 1]")
    seed = _int(spec, "seed", fields["seed"], 0) if "seed" in fields else 0
    return Fault(rank, point, action, after, argument, p, seed, fields.get("note", ""),
                 rng=random.Random(seed))


def _my_rank() -> int:
    try:
        return int(os.environ.get("DDL_RANK", "0"), 10)
    except ValueError:
        return 0


def arm(text: Optional[str], rank: Optional[int] = None) -> None:
    """(Re)arm from a spec for this process (``rank`` defaults to ``DDL_RANK``);
    ``None`` or ``""`` disarms. Tests call it in-process; workers arm at import."""
    global ACTIVE, _rank
    faults = parse(text) if text else []
    _rank = _my_rank() if rank is None else rank
    mine = [f for f in faults if f.rank is None or f.rank == _rank]
    by_point: Dict[str, List[Fault]] = {}
    for f in mine:
        by_point.setdefault(f.point, []).append(f)
    ACTIVE = by_point or None


def hit(point: str) -> None:
    """The program reached ``point``: act if a fault says so."""
    faults = (ACTIVE or {}).get(point)
    if not faults:
        return
    due = []
    with _lock:
        for f in faults:
            if f.done:
                continue
            index = f.hits
            f.hits += 1
            if index < f.after or (f.p < 1.0 and f.rng.random() >= f.p):
                continue
            f.done = True
            due.append((f, index))
    for f, index in due:
        _act(f, point, index)


def _act(f: Fault, point: str, index: int) -> None:
    line = f"{_rank} {point} {index} {time.monotonic():.6f} {f.action}"
    if f.note:
        try:
            with open(f.note, "a") as out:
                out.write(line + "\n")
        except OSError:
            pass
    try:
        os.write(2, f"ddl fault injected: rank {_rank} at {point} (hit {index}): "
                    f"{f.action}\n".encode())
    except OSError:
        pass
    if f.action in _SIGNALS:
        os.kill(os.getpid(), _SIGNALS[f.action])
    elif f.action == "abort":
        sys.stderr.flush()
        os.abort()
    elif f.action == "exit":
        os._exit(int(f.argument))
    elif f.action == "sleep":
        time.sleep(f.argument)
    elif f.action == "raise":
        raise FaultInjected(f"fault injected on rank {_rank} at {point} (hit {index})")


_lock = threading.Lock()
_rank = 0
ACTIVE: Optional[Dict[str, List[Fault]]] = None
arm(os.environ.get(ENV))
