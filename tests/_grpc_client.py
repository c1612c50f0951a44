"""A small real gRPC client of the coordinator, for tests: register, then a stream fed by a
queue, with every wait bounded."""

from __future__ import annotations

import queue
import threading
from typing import Iterator, List, Optional, Sequence

import grpc

from ddl.core.auth import GRPC_METADATA_KEY, grpc_token
from ddl.v1 import coordinator_pb2 as pb
from ddl.v1 import coordinator_pb2_grpc as pb_grpc

SECRET = "ab" * 32
JOB = "job-test"


def metadata(secret: str = SECRET, job_id: str = JOB):
    return ((GRPC_METADATA_KEY, grpc_token(secret, job_id)),)


def req(name: str, op: int = pb.ALLREDUCE, dtype: int = pb.FLOAT32, shape=(4,),
        reduce_op: Optional[int] = None, **kw) -> pb.Request:
    """A Request with allreduce/float32/Sum defaults."""
    if reduce_op is None:
        reduce_op = pb.SUM if op in (pb.ALLREDUCE, pb.REDUCESCATTER) else 0
    return pb.Request(name=name, op=op, dtype=dtype, shape=list(shape), reduce_op=reduce_op,
                      **kw)


class Client:
    """One fake worker: ``register()``, ``open()``, ``send()``, ``recv()``, ``goodbye()``."""

    def __init__(self, address: str, rank: int, size: int, host: str = "h",
                 pid: int = 1000, job_id: str = JOB, secret: str = SECRET):
        self.rank, self.size, self.host, self.pid, self.job_id = rank, size, host, pid, job_id
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.md = metadata(secret, job_id)
        self._out: "queue.Queue[Optional[pb.WorkerMessage]]" = queue.Queue()
        self.inbox: "queue.Queue[object]" = queue.Queue()
        self.call = None
        self._closed = threading.Event()
        self.heartbeats = 0
        self.departures: List[pb.Error] = []

    def register(self, timeout: float = 10.0, **overrides) -> pb.RegisterResponse:
        fields = dict(rank=self.rank, size=self.size, hostname=self.host, pid=self.pid,
                      data_address=f"127.0.0.1:{5000 + self.rank}", job_id=self.job_id)
        fields.update(overrides)
        return self.stub.Register(pb.RegisterRequest(**fields), metadata=self.md,
                                  timeout=timeout)

    def _requests(self) -> Iterator[pb.WorkerMessage]:
        while not self._closed.is_set():
            try:
                msg = self._out.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg is None:
                return
            yield msg

    def open(self, hello: Optional[pb.WorkerMessage] = None, timeout: float = 30.0) -> None:
        """Open the Negotiate stream and send ``hello`` (default: this rank's)."""
        self._out.put(hello or pb.WorkerMessage(hello=pb.Hello(rank=self.rank,
                                                               job_id=self.job_id)))
        self.call = self.stub.Negotiate(self._requests(), metadata=self.md, timeout=timeout)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                if msg.WhichOneof("kind") == "heartbeat":
                    self.heartbeats += 1
                    continue
                if msg.WhichOneof("kind") == "warning" and msg.warning.kind == pb.PEER_LOST:
                    self.departures.append(msg.warning)  # "rank r has shut down" notices
                    continue
                self.inbox.put(msg)
            self.inbox.put(("end", None))
        except grpc.RpcError as exc:
            self.inbox.put(("error", exc))

    def send(self, *requests: pb.Request) -> None:
        self._out.put(pb.WorkerMessage(requests=pb.RequestList(rank=self.rank,
                                                               requests=list(requests))))

    def goodbye(self) -> None:
        self._out.put(pb.WorkerMessage(goodbye=pb.Goodbye(rank=self.rank, reason="shutdown")))

    def recv(self, timeout: float = 5.0) -> object:
        """Next non-heartbeat message, ``("end", None)`` or ``("error", RpcError)``."""
        return self.inbox.get(timeout=timeout)

    def responses(self, n: int, timeout: float = 5.0) -> List[pb.Response]:
        """The next ``n`` responses (across ResponseLists); fails on anything else."""
        out: List[pb.Response] = []
        while len(out) < n:
            msg = self.recv(timeout)
            assert isinstance(msg, pb.CoordinatorMessage) and msg.HasField("responses"), msg
            out.extend(msg.responses.responses)
        assert len(out) == n, out
        return out

    def expect(self, kind: str, timeout: float = 5.0) -> pb.CoordinatorMessage:
        msg = self.recv(timeout)
        assert isinstance(msg, pb.CoordinatorMessage) and msg.WhichOneof("kind") == kind, msg
        return msg

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    def close(self) -> None:
        self._closed.set()
        self.cancel()
        self.channel.close()


def register_all(clients: Sequence[Client], timeout: float = 10.0) -> List[object]:
    """Register every client concurrently; each result is a response or an RpcError."""
    results: List[object] = [None] * len(clients)

    def one(i: int) -> None:
        try:
            results[i] = clients[i].register(timeout=timeout)
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True)
               for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return results
