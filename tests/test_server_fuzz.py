"""Coordinator fuzzing: random, truncated and field-mutated messages against the real daemon.

Requirement (issue tracker): "coordinator fuzzing: 10,000 random, truncated and
field-mutated messages from an authenticated client and from an unauthenticated one. Pass
figure: each answered with an error status within 1 s; the daemon stays up; its RSS grows
by < 50 MiB."

The daemon (the leader) runs as a subprocess (``python -m ddl.server.daemon``) on a unix
socket in a private 0700 directory, with a long start timeout so the rendezvous never
aborts the job during the run. Calls go through generic channel methods with identity
serializers, so any bytes can be sent to ``Register``, ``Ping`` and the bidirectional
``Negotiate`` and (where the stubs have it) ``PeerLink``.

Every call has a 1 s deadline and its own expected answer (the oracle), computed from the
payload with the same protobuf parser the server uses:

* unauthenticated (no token, a wrong one, ...): UNAUTHENTICATED, whatever the payload,
  valid messages included;
* authenticated, payload that does not parse: INVALID_ARGUMENT (the server decodes
  requests in its handlers; a request gRPC itself fails to deserialize would leak its call
  state in grpcio 1.85); for a stream this is about its first message;
* authenticated ``Register``, ``Negotiate`` or ``PeerLink`` that parses: INVALID_ARGUMENT.
  No acceptable call is ever sent (:func:`acceptable` filters out a valid registration and
  a PeerLink hello naming this job), so every worker ``hello`` names an unregistered rank
  and every stream is refused at its first message;
* authenticated ``Ping`` that parses: OK with the daemon's identity. ``PingRequest`` has
  no fields, so under proto3 any well-formed bytes (unknown fields) are a valid ping; an
  error there would be wrong, so such pings are the one expected success.

A stream counts as answered with an error when it ends with the expected non-OK status
before its deadline and delivered no message first; some streams keep their request side
open, so the answer must not depend on the client half-closing. DEADLINE_EXCEEDED is
always a failure (a hang).

After a warm-up, the cases run in batches of 1,000 on a few client threads; after each
batch the daemon must still run, answer a valid Ping and have no rank registered. At the
end its RSS (``VmRSS``) must be less than 50 MiB above the post-warm-up figure, and its
stderr must hold no traceback. On top of the pass figure, RSS may grow by at most 2 MiB
per 1,000 calls over the second half of the run: a steady leak must fail however the mix
happens to fall (healthy runs grow about 0.1 MiB per 1,000 calls there).

Knobs (``DDL_TEST_*`` is reserved for tests, so the strict configuration ignores it):
``DDL_TEST_SEED`` (the seed is printed; a failure prints it with the case index and
payload), ``DDL_TEST_FUZZ_COUNT`` (default 10000) and ``DDL_TEST_FUZZ_THREADS``
(default 2).

Kept out of the fuzz mix on purpose: payloads over gRPC's 4 MiB receive limit (refused
RESOURCE_EXHAUSTED by gRPC itself, with a latency that varies up to about 1 s on a 2-core
machine), job ids long enough to overflow the status metadata, and streams that close
without any message; the last two have their own tests below.
"""

from __future__ import annotations

import collections
import math
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import pytest

from ddl.core.auth import GRPC_METADATA_KEY, grpc_token
from ddl.v1 import coordinator_pb2 as pb

from _grpc_client import JOB, SECRET, metadata

pytestmark = pytest.mark.timeout(300)

SIZE = 4  # job size of the fuzzed daemon; no rank ever registers
CALL_TIMEOUT_S = 1.0
BATCH = 1000  # calls between two liveness checks
WARMUP_CALLS = 500
RSS_GROWTH_LIMIT = 50 << 20  # the requirement's pass figure, over the whole run
LEAK_SLOPE_LIMIT = 2 << 20  # per BATCH calls once warm: a steady leak fails even below 50 MiB
DEFAULT_SEED = 20240611
DEFAULT_COUNT = 10_000
DEFAULT_THREADS = 2
SERVICE = "/ddl.v1.Coordinator/"
# PeerLink (non-leader coordinators -> leader) is fuzzed where the stubs have it.
HAS_PEER_LINK = hasattr(pb, "PeerMessage")
METHODS = ("Register", "Ping", "Negotiate") + (("PeerLink",) if HAS_PEER_LINK else ())
METHOD_WEIGHTS = (3, 2, 3, 2)[:len(METHODS)]
STREAM_METHODS = ("Negotiate", "PeerLink")
PARSERS = {"Register": pb.RegisterRequest, "Ping": pb.PingRequest,
           "Negotiate": pb.WorkerMessage}
if HAS_PEER_LINK:
    PARSERS["PeerLink"] = pb.PeerMessage
OK = grpc.StatusCode.OK

TOKEN = grpc_token(SECRET, JOB)
VALID_AUTH = "valid"
BAD_CREDENTIALS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "no-metadata": (),
    "wrong-secret": metadata(secret="cd" * 32),
    "wrong-job": metadata(job_id=JOB + "-other"),
    "truncated-token": ((GRPC_METADATA_KEY, TOKEN[:-1]),),
    "flipped-token": ((GRPC_METADATA_KEY, TOKEN[:-1] + ("1" if TOKEN[-1] == "0" else "0")),),
    "upper-case-token": ((GRPC_METADATA_KEY, TOKEN.upper()),),
    "empty-token": ((GRPC_METADATA_KEY, ""),),
    "token-under-other-key": (("authorization", TOKEN),),
    "secret-as-token": ((GRPC_METADATA_KEY, SECRET),),
    "zero-token": ((GRPC_METADATA_KEY, "0" * 64),),
}
CREDENTIALS = dict(BAD_CREDENTIALS, **{VALID_AUTH: metadata()})


def env_int(name: str, default: int) -> int:
    """An integer test knob from the environment (any base Python accepts), or ``default``."""
    text = os.environ.get(name, "").strip()
    return int(text, 0) if text else default


# -- the oracle ------------------------------------------------------------------------
def parse(method: str, data: bytes):
    """``data`` parsed as ``method``'s request type, or None where the server cannot."""
    try:
        return PARSERS[method].FromString(data)
    except Exception:  # the server's handler answers INVALID_ARGUMENT
        return None


def would_register(data: bytes) -> bool:
    """Whether ``data`` is a Register the daemon would accept (and then block on)."""
    msg = parse("Register", data)
    return (msg is not None and msg.job_id == JOB and msg.size == SIZE
            and 0 <= msg.rank < SIZE)


def would_link(data: bytes) -> bool:
    """Whether ``data`` is a PeerLink hello the leader would accept (opening a link)."""
    msg = parse("PeerLink", data) if HAS_PEER_LINK else None
    return (msg is not None and msg.WhichOneof("kind") == "hello"
            and msg.hello.job_id == JOB)


def acceptable(method: str, data: bytes) -> bool:
    """Whether an authenticated ``method`` call starting with ``data`` would be accepted
    rather than refused; the fuzzer never sends one (see :meth:`Fuzzer.safe_payload`)."""
    if method == "Register":
        return would_register(data)
    if method == "PeerLink":
        return would_link(data)
    return False  # no rank registers, so no Negotiate hello can be accepted


def expected_codes(method: str, messages: Sequence[bytes], auth: str
                   ) -> Tuple[grpc.StatusCode, ...]:
    """The statuses a correct daemon may answer; see the module docstring."""
    if auth != VALID_AUTH:
        return (grpc.StatusCode.UNAUTHENTICATED,)
    if parse(method, messages[0]) is None:
        return (grpc.StatusCode.INVALID_ARGUMENT,)
    return (OK,) if method == "Ping" else (grpc.StatusCode.INVALID_ARGUMENT,)


def expect_names(codes: Sequence[grpc.StatusCode]) -> str:
    """Status names for messages, e.g. ``INTERNAL|INVALID_ARGUMENT``."""
    return "|".join(c.name for c in codes)


# -- protobuf wire encoding (for malformed payloads) ----------------------------------
def varint(value: int) -> bytes:
    """Base-128 varint of ``value`` (negative numbers as 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    """A field key (tag) of ``field`` with ``wire_type``."""
    return varint(field << 3 | wire_type)


def length_delimited(field: int, data: bytes) -> bytes:
    """One length-delimited field (wire type 2)."""
    return key(field, 2) + varint(len(data)) + data


@dataclass(frozen=True)
class Case:
    """One call: its method, payload(s), how they were made and which credentials."""

    index: int
    method: str
    messages: Tuple[bytes, ...]  # one for unary methods; the stream's messages otherwise
    kind: str  # how the payload was made, e.g. "mutated:register.rank"
    auth: str  # VALID_AUTH or a key of BAD_CREDENTIALS
    keep_open: bool  # streams: leave the request side open after the messages
    expect: Tuple[grpc.StatusCode, ...]  # the acceptable answers

    def describe(self, limit: int = 256) -> str:
        """A one-line reproduction of this case (payloads in hex, cut at ``limit`` bytes)."""
        shown = ", ".join(f"{len(m)}B:{m[:limit].hex()}{'...' if len(m) > limit else ''}"
                          for m in self.messages)
        return (f"#{self.index} {self.method} auth={self.auth} kind={self.kind} "
                f"keep_open={self.keep_open} expect={expect_names(self.expect)} "
                f"messages=[{shown}]")


# -- case generation -------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
# The daemon quotes a wrong job id in its status message, and gRPC clients refuse status
# metadata over 8 KiB (see test_long_job_id_is_refused_invalid_argument), so job ids stay
# well below that here.
ECHO_SAFE = 3000
REGISTER_BREAKERS = {  # each alone makes a registration invalid
    "rank": [SIZE, SIZE + 1, -1, -2**31, 2**31 - 1, 10**6],
    "size": [0, -1, SIZE - 1, SIZE + 1, 2**31 - 1, -2**31],
    "job_id": ["", JOB + "x", JOB.upper(), JOB[:-1], " " + JOB, JOB + "\0", "x" * ECHO_SAFE,
               "\u30b8\u30e7\u30d6"],
}
REGISTER_EXTRAS = {  # odd but harmless on their own
    "hostname": ["", "h" * 10_000, "\0", "h\nost", "\U0001F642"],
    "pid": [-1, 0, 2**31 - 1, -2**31],
    "data_address": ["", "nohost", ":0", "[::1]:99999", "a" * 5_000],
}
REQUEST_MUTATIONS = {
    "name": ["", "n" * 20_000, "\0", "grad/\u00e9\u4e2d", "a\nb"],
    "op": [0, 10, 99, 2**31 - 1, -1],
    "dtype": [0, 12, 1000, -5],
    "reduce_op": [0, 6, 77, -1],
    "shape": [[2**62, 2**62], [2**63 - 1], [1 << 40] * 8, [-1], [3, -7], [-2**63],
              [1] * 2000],
    "root_rank": [-1, SIZE, 2**31 - 1, -2**31],
    "prescale_factor": [NAN, INF, -INF, -0.0, 1e308, 5e-324],
    "postscale_factor": [NAN, -INF, 0.0, -1.0],
    "process_set_id": [2**32 - 1, 7],
    "splits": [[-1, 5], [2**62, 2**62], [0] * 1000],
    "member_ranks": [[3, 1], [0, 0], [-1, SIZE], [2**31 - 1]],
}
HELLO_MUTATIONS = {
    "rank": list(range(SIZE)) + [-1, SIZE, 2**31 - 1, -2**31],  # none has registered
    "job_id": [JOB, "", JOB + "x", JOB.upper(), "x" * ECHO_SAFE],
}
PEER_HELLO_BREAKERS = {"job_id": ["", JOB + "x", JOB.upper(), JOB[:-1], "x" * ECHO_SAFE]}
PEER_HELLO_EXTRAS = {  # the leader quotes the hostname next to the job id
    "hostname": ["", "h" * ECHO_SAFE, "\0", "\U0001F642"],
    "pid": [-1, 0, 2**31 - 1, -2**31],
}


class Fuzzer:
    """Makes the cases of one run, in a fixed order, from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.next_index = 0

    # -- building blocks ---------------------------------------------------------------
    def random_bytes(self) -> bytes:
        """Random bytes, mostly short (short inputs reach the most parser states)."""
        r = self.rng.random()
        top = 8 if r < 0.3 else 64 if r < 0.7 else 1024 if r < 0.95 else 32 << 10
        return self.rng.randbytes(self.rng.randint(0, top))

    def valid_register(self) -> pb.RegisterRequest:
        """A registration the daemon would accept (only ever sent without credentials)."""
        rank = self.rng.randrange(SIZE)
        return pb.RegisterRequest(rank=rank, size=SIZE, hostname="h", pid=1000 + rank,
                                  data_address=f"127.0.0.1:{5000 + rank}", job_id=JOB)

    def valid_request(self) -> pb.Request:
        """A plausible collective request."""
        op = self.rng.choice([pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.BARRIER])
        return pb.Request(name=f"t{self.rng.randrange(100)}", op=op, dtype=pb.FLOAT32,
                          shape=[4, 2], reduce_op=pb.SUM if op == pb.ALLREDUCE else 0)

    def valid_worker_message(self) -> pb.WorkerMessage:
        """A well-formed hello, request list, heartbeat or goodbye of an in-range rank."""
        rank = self.rng.randrange(SIZE)
        which = self.rng.choice(["hello", "requests", "heartbeat", "goodbye"])
        if which == "hello":
            return pb.WorkerMessage(hello=pb.Hello(rank=rank, job_id=JOB))
        if which == "requests":
            reqs = [self.valid_request() for _ in range(self.rng.randint(1, 3))]
            return pb.WorkerMessage(requests=pb.RequestList(rank=rank, requests=reqs))
        if which == "heartbeat":
            return pb.WorkerMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))
        return pb.WorkerMessage(goodbye=pb.Goodbye(rank=rank, reason="shutdown"))

    def valid_peer_message(self) -> "pb.PeerMessage":
        """A well-formed peer hello, relayed worker message, heartbeat or closed notice."""
        which = self.rng.choice(["hello", "hello", "worker", "heartbeat", "closed"])
        if which == "hello":
            return pb.PeerMessage(hello=pb.PeerHello(job_id=JOB, hostname="node1", pid=4242))
        rank = self.rng.randrange(SIZE)
        if which == "worker":
            return pb.PeerMessage(worker=pb.RankMessage(rank=rank,
                                                        message=self.valid_worker_message()))
        if which == "heartbeat":
            return pb.PeerMessage(heartbeat=pb.Heartbeat(sent_unix_s=time.time()))
        return pb.PeerMessage(closed=pb.RankClosed(rank=rank, cause="lost"))

    def valid_payload(self, method: str) -> bytes:
        """A well-formed message of ``method`` (sent valid only without credentials)."""
        if method == "Register":
            return self.valid_register().SerializeToString()
        if method == "Ping":
            return b""
        if method == "PeerLink":
            return self.valid_peer_message().SerializeToString()
        return self.valid_worker_message().SerializeToString()

    def any_valid_bytes(self) -> bytes:
        """A serialized message of any request type (a PingRequest reads it as unknowns)."""
        others = [m for m in METHODS if m != "Ping"]
        return self.valid_payload(self.rng.choice(others))

    # -- field mutations ---------------------------------------------------------------
    def mutated_register(self) -> Tuple[bytes, str]:
        """A RegisterRequest with one breaking field and up to two odd extras."""
        fields = {f: getattr(self.valid_register(), f) for f in
                  ("rank", "size", "hostname", "pid", "data_address", "job_id")}
        name = self.rng.choice(sorted(REGISTER_BREAKERS))
        fields[name] = self.rng.choice(REGISTER_BREAKERS[name])
        for extra in self.rng.sample(sorted(REGISTER_EXTRAS), self.rng.randint(0, 2)):
            fields[extra] = self.rng.choice(REGISTER_EXTRAS[extra])
        return pb.RegisterRequest(**fields).SerializeToString(), f"register.{name}"

    def mutated_request(self) -> Tuple[pb.Request, str]:
        """A Request with one to three fields set to hostile values."""
        req = self.valid_request()
        names = self.rng.sample(sorted(REQUEST_MUTATIONS), self.rng.randint(1, 3))
        for name in names:
            value = self.rng.choice(REQUEST_MUTATIONS[name])
            if isinstance(value, list):
                getattr(req, name)[:] = value
            else:
                setattr(req, name, value)
        return req, "+".join(names)

    def mutated_worker_message(self) -> Tuple[bytes, str]:
        """A first stream message the daemon must refuse: a hello of an unregistered rank
        or wrong job, or anything else before hello (requests, heartbeat, goodbye, empty)."""
        which = self.rng.choice(["hello", "hello", "requests", "requests", "heartbeat",
                                 "goodbye", "empty"])
        if which == "hello":
            hello = pb.Hello(rank=self.rng.choice(HELLO_MUTATIONS["rank"]),
                             job_id=self.rng.choice(HELLO_MUTATIONS["job_id"]))
            return pb.WorkerMessage(hello=hello).SerializeToString(), "hello"
        if which == "requests":
            reqs, labels = [], []
            for _ in range(self.rng.randint(1, 4)):
                req, label = self.mutated_request()
                reqs.append(req)
                labels.append(label)
            rank = self.rng.choice([0, SIZE - 1, -1, SIZE, 2**31 - 1])
            msg = pb.WorkerMessage(requests=pb.RequestList(rank=rank, requests=reqs))
            return msg.SerializeToString(), "requests-before-hello:" + ",".join(labels)
        if which == "heartbeat":
            t = self.rng.choice([NAN, -INF, INF, -1.0, 0.0, 1e308])
            return pb.WorkerMessage(heartbeat=pb.Heartbeat(sent_unix_s=t)).SerializeToString(), \
                "heartbeat-before-hello"
        if which == "goodbye":
            bye = pb.Goodbye(rank=self.rng.choice([0, -1, SIZE]), reason="r" * 5000)
            return pb.WorkerMessage(goodbye=bye).SerializeToString(), "goodbye-before-hello"
        return b"", "empty-message"

    def mutated_peer_message(self) -> Tuple[bytes, str]:
        """A first PeerLink message the leader must refuse: a hello naming another job, or
        anything else before hello (a relayed worker message, heartbeat, closed, empty)."""
        which = self.rng.choice(["hello", "hello", "worker", "heartbeat", "closed", "empty"])
        if which == "hello":
            fields = {"job_id": self.rng.choice(PEER_HELLO_BREAKERS["job_id"]),
                      "hostname": "node1", "pid": 4242}
            for extra in self.rng.sample(sorted(PEER_HELLO_EXTRAS), self.rng.randint(0, 2)):
                fields[extra] = self.rng.choice(PEER_HELLO_EXTRAS[extra])
            return pb.PeerMessage(hello=pb.PeerHello(**fields)).SerializeToString(), \
                "peer-hello.job_id"
        if which == "worker":
            inner = pb.WorkerMessage.FromString(self.mutated_worker_message()[0])
            rank = self.rng.choice(list(range(SIZE)) + [-1, SIZE, 2**31 - 1])
            msg = pb.PeerMessage(worker=pb.RankMessage(rank=rank, message=inner))
            return msg.SerializeToString(), "worker-before-hello"
        if which == "heartbeat":
            t = self.rng.choice([NAN, -INF, 1e308])
            return pb.PeerMessage(heartbeat=pb.Heartbeat(sent_unix_s=t)).SerializeToString(), \
                "heartbeat-before-hello"
        if which == "closed":
            closed = pb.RankClosed(rank=self.rng.choice([0, -1, SIZE]), cause="c" * 3000)
            return pb.PeerMessage(closed=closed).SerializeToString(), "closed-before-hello"
        return b"", "empty-message"

    def mutated_ping(self) -> Tuple[bytes, str]:
        """A PingRequest carrying another message's fields (unknown to it)."""
        return self.any_valid_bytes(), "ping.unknown-fields"

    def mutated(self, method: str) -> Tuple[bytes, str]:
        """A field-mutated message of ``method``."""
        make = {"Register": self.mutated_register, "Ping": self.mutated_ping,
                "Negotiate": self.mutated_worker_message,
                "PeerLink": self.mutated_peer_message}[method]
        return make()

    # -- wire mutations ----------------------------------------------------------------
    def wire_mutated(self, data: bytes) -> Tuple[bytes, str]:
        """``data`` damaged at the wire level; the label names the damage."""
        rng = self.rng
        name = rng.choice(sorted(WIRE_MUTATORS))
        return WIRE_MUTATORS[name](rng, data), name

    def truncated(self, method: str) -> bytes:
        """A valid message of ``method`` (any message, for Ping) cut short."""
        data = self.any_valid_bytes() if method == "Ping" else self.valid_payload(method)
        if self.rng.random() < 0.3:  # hostile fields make longer, more varied prefixes
            data = self.mutated(method)[0] or data
        return data[:self.rng.randrange(len(data))] if data else data

    # -- whole cases -------------------------------------------------------------------
    def payload(self, method: str, authenticated: bool) -> Tuple[bytes, str]:
        """One payload of ``method`` and how it was made."""
        r = self.rng.random()
        if not authenticated and r < 0.1:
            return self.valid_payload(method), "valid"
        if r < 0.3:
            return self.random_bytes(), "random"
        if r < 0.55:
            return self.truncated(method), "truncated"
        if r < 0.8:
            data, label = self.mutated(method)
            return data, f"mutated:{label}"
        base = self.rng.choice([self.valid_payload(method), self.mutated(method)[0]])
        data, label = self.wire_mutated(base)
        return data, f"wire:{label}"

    def safe_payload(self, method: str, authenticated: bool) -> Tuple[bytes, str]:
        """Like :meth:`payload`, but never an acceptable call from an authenticated
        client: a valid Register would block on the rendezvous and take a rank for good,
        a valid PeerLink hello would open a link."""
        while True:
            data, kind = self.payload(method, authenticated)
            if not (authenticated and acceptable(method, data)):
                return data, kind

    def follow_ups(self, method: str) -> List[bytes]:
        """What a stream sends after its first message: mostly nothing, else valid
        messages (hello included) or garbage; the daemon must not read past the first."""
        out = []
        for _ in range(self.rng.choice([0, 0, 0, 1, 2])):
            pick = self.rng.random()
            out.append(self.valid_payload(method) if pick < 0.6 else self.random_bytes())
        return out

    def case(self, authenticated: bool) -> Case:
        """The next case for an authenticated or unauthenticated client."""
        method = self.rng.choices(METHODS, weights=METHOD_WEIGHTS)[0]
        auth = VALID_AUTH if authenticated else self.rng.choice(sorted(BAD_CREDENTIALS))
        first, kind = self.safe_payload(method, authenticated)
        messages = (first,)
        keep_open = False
        if method in STREAM_METHODS:
            messages += tuple(self.follow_ups(method))
            keep_open = self.rng.random() < 0.3
        index, self.next_index = self.next_index, self.next_index + 1
        return Case(index, method, messages, kind, auth, keep_open,
                    expected_codes(method, messages, auth))

    def cases(self, n: int) -> List[Case]:
        """``n`` cases, alternately authenticated and not (an even split)."""
        return [self.case(authenticated=(self.next_index % 2 == 0)) for _ in range(n)]


def _flip_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flip one to four bits of random bytes."""
    buf = bytearray(data or b"\x00")
    for _ in range(rng.randint(1, 4)):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _insert_bytes(rng: random.Random, data: bytes) -> bytes:
    """Insert 1-16 random bytes somewhere."""
    at = rng.randint(0, len(data))
    return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]


def _delete_slice(rng: random.Random, data: bytes) -> bytes:
    """Remove a random slice."""
    if not data:
        return b"\x08"
    a = rng.randrange(len(data))
    return data[:a] + data[rng.randint(a + 1, len(data)):]


def _duplicate(rng: random.Random, data: bytes) -> bytes:
    """The message twice (protobuf merges the copies)."""
    return data + data


def _unknown_field(rng: random.Random, data: bytes) -> bytes:
    """A well-formed field with a number the schema does not know."""
    field = rng.choice([20, 99, 1000, 2**29 - 1])
    wire = rng.choice([0, 1, 2, 5])
    body = {0: varint(rng.getrandbits(64)), 1: rng.randbytes(8), 5: rng.randbytes(4),
            2: varint(3) + b"abc"}[wire]
    return data + key(field, wire) + body


def _wrong_wire_type(rng: random.Random, data: bytes) -> bytes:
    """A known field number (1-6) with a wire type that does not match the schema."""
    field = rng.randint(1, 6)
    return data + rng.choice([key(field, 1) + rng.randbytes(8), key(field, 5) + rng.randbytes(4),
                              key(field, 0) + varint(rng.getrandbits(64)),
                              length_delimited(field, rng.randbytes(rng.randint(0, 9)))])


def _overlong_varint(rng: random.Random, data: bytes) -> bytes:
    """An 11-byte varint, one more than the format allows."""
    return data + key(rng.randint(1, 6), 0) + b"\xff" * 10 + b"\x01"


def _length_overflow(rng: random.Random, data: bytes) -> bytes:
    """A length prefix far beyond the bytes that follow."""
    return data + key(rng.randint(1, 6), 2) + varint(rng.choice([50, 2**31, 2**63])) + b"abc"


def _deep_groups(rng: random.Random, data: bytes) -> bytes:
    """Nested unknown groups, below and beyond the parser's recursion limit."""
    depth = rng.choice([5, 99, 101, 200, 3000])
    return data + key(19, 3) * depth + key(19, 4) * depth


def _bad_tag(rng: random.Random, data: bytes) -> bytes:
    """Field number 0, wire types 6 and 7, or an end-group with no start."""
    return data + rng.choice([b"\x00", b"\x06", b"\x07", b"\x0e", b"\x0f", b"\x0c",
                              key(2**29 + 5, 0)])


def _bad_utf8(rng: random.Random, data: bytes) -> bytes:
    """Invalid UTF-8 in a length-delimited field (a string field for Register)."""
    return data + length_delimited(rng.randint(1, 6), rng.choice([b"\xff\xfe", b"\xc0\x80",
                                                                   b"\xed\xa0\x80"]))


def _splice(rng: random.Random, data: bytes) -> bytes:
    """A prefix of the message followed by random bytes."""
    return data[:rng.randint(0, len(data))] + rng.randbytes(rng.randint(1, 32))


WIRE_MUTATORS: Dict[str, Callable[[random.Random, bytes], bytes]] = {
    "flip-bits": _flip_bytes, "insert": _insert_bytes, "delete": _delete_slice,
    "duplicate": _duplicate, "unknown-field": _unknown_field,
    "wrong-wire-type": _wrong_wire_type, "overlong-varint": _overlong_varint,
    "length-overflow": _length_overflow, "deep-groups": _deep_groups, "bad-tag": _bad_tag,
    "bad-utf8": _bad_utf8, "splice": _splice,
}


# -- the daemon ------------------------------------------------------------------------
class Daemon:
    """The coordinator daemon as a subprocess on a unix socket in ``sockdir``."""

    def __init__(self, sockdir: str):
        self.sockdir = sockdir
        self.stderr_path = os.path.join(sockdir, "daemon.stderr")
        self._stderr = open(self.stderr_path, "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
        env.update(DDL_JOB_ID=JOB, DDL_JOB_SECRET=SECRET,
                   DDL_LAUNCHER_PID=str(os.getpid()))  # it dies with this process
        wanted = f"unix:{sockdir}/c.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddl.server.daemon", "--address", wanted,
             "--size", str(SIZE), "--start-timeout", "600"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True)
        self.pid = self.proc.pid
        self.address = self._read_address(timeout=30.0)
        assert self.address == wanted, (self.address, self.stderr())

    def _read_address(self, timeout: float) -> str:
        """The bound address the daemon prints on stdout."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the daemon printed no address within {timeout} s: {self.stderr()}"
        line = self.proc.stdout.readline().strip()
        assert line, f"the daemon exited ({self.proc.poll()}): {self.stderr()}"
        return line

    def stderr(self) -> str:
        """Everything the daemon logged so far."""
        self._stderr.flush()
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def rss_bytes(self) -> int:
        """Resident set size, from /proc/PID/status."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for pid {self.pid}")

    def stop(self) -> None:
        """Kill the daemon (if still running) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture
def daemon():
    """A fresh daemon in a private temp dir; killed and removed afterwards."""
    sockdir = tempfile.mkdtemp(prefix="ddl-fz", dir="/tmp")  # short: unix paths are limited
    os.chmod(sockdir, 0o700)
    d: Optional[Daemon] = None
    try:
        d = Daemon(sockdir)
        yield d
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


# -- the client ------------------------------------------------------------------------
@dataclass
class Outcome:
    """How one call ended."""

    code: grpc.StatusCode
    details: str
    elapsed_s: float
    replies: int  # stream messages received before the status
    body: bytes = b""  # the response of a unary call that succeeded


class RawClient:
    """An authenticated and an unauthenticated channel sending raw bytes (identity
    serializers) to every method of the service."""

    def __init__(self, address: str):
        self._channels = {True: grpc.insecure_channel(address),
                          False: grpc.insecure_channel(address)}
        self._unary = {(auth, m): ch.unary_unary(SERVICE + m)
                       for auth, ch in self._channels.items() for m in ("Register", "Ping")}
        self._stream = {(auth, m): ch.stream_stream(SERVICE + m)
                        for auth, ch in self._channels.items() for m in STREAM_METHODS}

    def call(self, case: Case) -> Outcome:
        """Send ``case`` with a 1 s deadline and say how it ended."""
        authenticated = case.auth == VALID_AUTH
        md = CREDENTIALS[case.auth]
        replies = [0]
        t0 = time.monotonic()
        try:
            if case.method in STREAM_METHODS:
                self._stream_call(authenticated, case, md, replies)
                body = b""
            else:
                body = self._unary[authenticated, case.method](
                    case.messages[0], metadata=md, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            return Outcome(exc.code(), exc.details() or "", time.monotonic() - t0, replies[0])
        return Outcome(OK, "", time.monotonic() - t0, replies[0], body)

    def _stream_call(self, authenticated: bool, case: Case, md, replies: List[int]) -> None:
        """Run one bidirectional stream to its end, counting the messages it delivers."""
        release = threading.Event()

        def requests():
            yield from case.messages
            if case.keep_open:  # the answer must not wait for the client's half-close
                release.wait(CALL_TIMEOUT_S + 1.0)

        call = self._stream[authenticated, case.method](requests(), metadata=md,
                                                         timeout=CALL_TIMEOUT_S)
        try:
            for _ in call:
                replies[0] += 1
        finally:
            release.set()

    def ping(self) -> pb.PingResponse:
        """A valid authenticated Ping."""
        body = self._unary[True, "Ping"](b"", metadata=CREDENTIALS[VALID_AUTH],
                                          timeout=5.0)
        return pb.PingResponse.FromString(body)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


# -- checks ----------------------------------------------------------------------------
def problem(case: Case, outcome: Outcome, daemon_pid: int) -> Optional[str]:
    """What is wrong with ``outcome`` as the answer to ``case``, or None."""
    if outcome.code not in case.expect:
        return (f"expected {expect_names(case.expect)}, got {outcome.code.name} after "
                f"{outcome.elapsed_s:.3f} s: {outcome.details[:200]!r}")
    if outcome.replies:
        return f"the stream delivered {outcome.replies} message(s) before its status"
    if outcome.code == OK:
        try:
            pong = pb.PingResponse.FromString(outcome.body)
        except Exception as exc:
            return f"Ping answered OK with an unreadable body ({exc}): {outcome.body.hex()}"
        want = (JOB, SIZE, 0, True, daemon_pid)
        got = (pong.job_id, pong.size, pong.registered, pong.leader, pong.pid)
        if got != want:
            return f"Ping answered {got}, expected {want}"
    return None


def check_alive(daemon: Daemon, client: RawClient, done: int) -> None:
    """The daemon runs, answers a valid Ping, and still has no rank registered."""
    rc = daemon.proc.poll()
    assert rc is None, (f"the daemon exited with status {rc} after {done} fuzz calls; "
                        f"stderr tail:\n{daemon.stderr()[-3000:]}")
    try:
        pong = client.ping()
    except grpc.RpcError as exc:
        raise AssertionError(f"the daemon stopped answering Ping after {done} fuzz calls: "
                             f"{exc.code().name} {exc.details()}") from None
    assert (pong.job_id, pong.size, pong.pid) == (JOB, SIZE, daemon.pid), pong
    assert pong.registered == 0, f"a fuzz call registered a rank: {pong}"


class Tally:
    """Counts of what was sent and how it was answered, for the printed summary."""

    def __init__(self) -> None:
        self.sent: "collections.Counter[str]" = collections.Counter()
        self.codes: "collections.Counter[str]" = collections.Counter()
        self.latencies: List[float] = []
        self.wire_messages = 0

    def add(self, case: Case, outcome: Outcome) -> None:
        """Count one answered case."""
        who = "auth" if case.auth == VALID_AUTH else "unauth"
        self.sent[f"{who} {case.method} {case.kind.split(':')[0]}"] += 1
        self.codes[f"{who} {case.method} -> {outcome.code.name}"] += 1
        self.latencies.append(outcome.elapsed_s)
        self.wire_messages += len(case.messages)

    def percentile(self, q: float) -> float:
        """The ``q`` quantile of the call latencies, seconds."""
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    def summary(self) -> str:
        """Counts per kind and per answer, and the latency figures."""
        lines = [f"{len(self.latencies)} calls, {self.wire_messages} protobuf messages; "
                 f"latency p50 {self.percentile(0.5) * 1e3:.1f} ms, p99 "
                 f"{self.percentile(0.99) * 1e3:.1f} ms, max {max(self.latencies) * 1e3:.1f} ms"]
        lines += [f"  sent   {k}: {v}" for k, v in sorted(self.sent.items())]
        lines += [f"  answer {k}: {v}" for k, v in sorted(self.codes.items())]
        return "\n".join(lines)


def run_batch(client: RawClient, pool: ThreadPoolExecutor, cases: Sequence[Case],
              daemon_pid: int, tally: Tally) -> List[str]:
    """Send ``cases`` concurrently; the reproductions of the wrongly answered ones."""
    failures = []
    for case, outcome in zip(cases, pool.map(client.call, cases)):
        tally.add(case, outcome)
        why = problem(case, outcome, daemon_pid)
        if why is not None:
            failures.append(f"{why}\n    {case.describe()}")
    return failures


def failure_report(failures: Sequence[str], seed: int, done: int) -> str:
    """The assertion message for wrongly answered calls: the seed and the first ten."""
    shown = "\n".join(failures[:10])
    return (f"{len(failures)} fuzz call(s) answered wrongly (seed {seed}, DDL_TEST_SEED="
            f"{seed} to repeat; {done} calls so far):\n{shown}")


# -- the test --------------------------------------------------------------------------
def test_coordinator_fuzz(daemon):
    """10,000 hostile calls, half authenticated: each gets its expected status within
    1 s, the daemon stays up and its RSS grows by less than 50 MiB."""
    seed = env_int("DDL_TEST_SEED", DEFAULT_SEED)
    total = env_int("DDL_TEST_FUZZ_COUNT", DEFAULT_COUNT)
    threads = env_int("DDL_TEST_FUZZ_THREADS", DEFAULT_THREADS)
    print(f"fuzz seed: {seed} (DDL_TEST_SEED), {total} calls (DDL_TEST_FUZZ_COUNT), "
          f"{threads} client threads (DDL_TEST_FUZZ_THREADS)")
    fuzzer = Fuzzer(seed)
    client = RawClient(daemon.address)
    tally = Tally()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fuzz") as pool:
            failures = run_batch(client, pool, fuzzer.cases(WARMUP_CALLS), daemon.pid, tally)
            assert not failures, failure_report(failures, seed, 0)
            check_alive(daemon, client, 0)
            rss0 = daemon.rss_bytes()
            rss_trace = [rss0]
            done = 0
            while done < total:
                cases = fuzzer.cases(min(BATCH, total - done))
                failures = run_batch(client, pool, cases, daemon.pid, tally)
                done += len(cases)
                assert not failures, failure_report(failures, seed, done)
                check_alive(daemon, client, done)
                rss_trace.append(daemon.rss_bytes())
    finally:
        client.close()
    elapsed = time.monotonic() - t0
    growth, slope = rss_trace[-1] - rss0, steady_growth_per_batch(rss_trace)
    print(tally.summary())
    print(f"{done} calls after {WARMUP_CALLS} warm-up in {elapsed:.1f} s; daemon RSS MiB "
          f"after warm-up and per {BATCH} calls: {[round(r / 2**20, 1) for r in rss_trace]}; "
          f"growth {growth / 2**20:.1f} MiB, {slope / 2**20:.2f} MiB per {BATCH} calls in "
          f"the second half; daemon stderr {len(daemon.stderr())} bytes")
    log = daemon.stderr()
    assert "Traceback" not in log and "Exception in thread" not in log, log[-3000:]
    assert daemon.proc.poll() is None
    assert growth < RSS_GROWTH_LIMIT and slope < LEAK_SLOPE_LIMIT, (
        f"daemon RSS grew by {growth / 2**20:.1f} MiB over {done} fuzz calls (limit 50 MiB), "
        f"{slope / 2**20:.2f} MiB per {BATCH} calls in the second half (limit "
        f"{LEAK_SLOPE_LIMIT / 2**20:g}); MiB trace {[round(r / 2**20, 1) for r in rss_trace]}")


def steady_growth_per_batch(trace: Sequence[int]) -> float:
    """Mean RSS growth per batch over the second half of ``trace``: one-off allocations
    settle early, a leak keeps growing."""
    half = len(trace) // 2
    batches = len(trace) - 1 - half
    return (trace[-1] - trace[half]) / batches if batches > 0 else 0.0


# -- defects the fuzz run found, kept fixed ---------------------------------------------
def test_long_job_id_is_refused_invalid_argument(daemon):
    """A 20,000-character job id, in Register or in hello, is refused like any other
    wrong job id: INVALID_ARGUMENT."""
    register = pb.RegisterRequest(rank=0, size=SIZE, job_id="x" * 20_000)
    hello = pb.WorkerMessage(hello=pb.Hello(rank=0, job_id="x" * 20_000))
    cases = [Case(0, "Register", (register.SerializeToString(),), "long-job-id", VALID_AUTH,
                  False, (grpc.StatusCode.INVALID_ARGUMENT,)),
             Case(1, "Negotiate", (hello.SerializeToString(),), "long-job-id", VALID_AUTH,
                  False, (grpc.StatusCode.INVALID_ARGUMENT,))]
    client = RawClient(daemon.address)
    try:
        problems = [problem(c, client.call(c), daemon.pid) for c in cases]
    finally:
        client.close()
    assert problems == [None, None]


@pytest.mark.parametrize("method", ["Negotiate", "PeerLink"])
def test_stream_closed_before_hello_is_answered_within_1s(daemon, method):
    """A Negotiate or PeerLink stream that half-closes without a message ends with
    INVALID_ARGUMENT within 1 s (no hello can come any more)."""
    client = RawClient(daemon.address)
    try:
        outcome = client.call(Case(0, method, (), "empty-stream", VALID_AUTH, False,
                                   (grpc.StatusCode.INVALID_ARGUMENT,)))
    finally:
        client.close()
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert outcome.replies == 0
