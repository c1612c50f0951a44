"""ddl on Spark: ``ddl.spark.run(fn, num_proc=N)`` runs ``fn`` as one ddl job of N ranks,
one per task of a Spark barrier stage, and returns the results in rank order.

Each task starts one rank as a fresh Python process (``python -m
ddl.launcher._fn_worker``: the function arrives through an inherited pipe, never argv or
the environment) that starts ddl from environment variables (:mod:`ddl.startup.tcp_rendezvous`):
its rank is the task's partition id, and task 0's address, found with the barrier's
``allGather``, is where the ranks meet. The job secret is made on the driver and reaches
the tasks inside the stage's closure, as Spark ships every task (as Horovod on Spark
does: protect Spark's own RPC with ``spark.authenticate`` and ``spark.network.crypto``
when the cluster is shared); it is never on a command line, and ranks prove it before
rank 0 reads anything.

Cross-rank contract: every rank runs ``fn(*args, **kwargs)`` between ``ddl.init()`` and
``ddl.shutdown()``. If any rank fails, the stage fails as a whole and :class:`ddl.RunError`
names the rank whose failure came first (the others fail because of it) with its
traceback; a rank's process dies with its task.

Start: a barrier stage starts all its tasks at once or none. If the ``num_proc`` tasks
have not all started within ``start_timeout`` (too few task slots, or executors that do
not come), the Spark job is cancelled and :class:`ddl.DDLTimeoutError` names
``num_proc``, the slots Spark has, and what to change; no rank has started.

Output: each rank's stdout and stderr reach the driver as they are written, each line
prefixed ``[rank]<stdout>:`` or ``[rank]<stderr>:`` (after the local time with
``prefix_output_with_timestamp``), and are written to ``run``'s ``stdout``/``stderr``
streams (default ``sys.stdout``/``sys.stderr``), as Horovod's. Each task connects to a
listener the driver opens for the job (loopback with a ``local`` master, else on every
address, reached at ``spark.driver.host``) and proves the job secret (HMAC-SHA256 of a
fresh challenge) before the driver reads a byte; lines are text, never unpickled. A task
that cannot reach it leaves its rank's output in the executor's log, as before.

Needs pyspark (``pip install 'ddl-train[spark]'``) and a Java runtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import IO, Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ddl import DDLTimeoutError, RunError
from ddl._client_api import engine_ranks

__all__ = ["run", "RunError"]

_MAC_LABEL = b"ddl-spark-output"
_POLL_S = 0.2  # how often the driver looks whether the stage's tasks started


def _mac(secret: str, nonce: bytes, rank: bytes) -> bytes:
    return hmac.new(secret.encode(), _MAC_LABEL + nonce + rank, hashlib.sha256).digest()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


# -- the driver's side of the ranks' output ----------------------------------------------
class _OutputSink:
    """On the driver, for one job: the listener each task sends its rank's output to;
    every proven line is written, prefixed, to ``out`` or ``err``. :meth:`close` (after
    the stage ended, when every task has closed its connection) waits for the writers."""

    def __init__(self, sc: Any, secret: str, out: IO[str], err: IO[str], timestamps: bool):
        local = str(sc.master).startswith("local")
        self._secret, self._out, self._err, self._timestamps = secret, out, err, timestamps
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1" if local else "0.0.0.0", 0))
        self._listener.listen(128)
        host = "127.0.0.1" if local else sc.getConf().get("spark.driver.host")
        self.address: Tuple[str, int] = (host, self._listener.getsockname()[1])
        self._readers: List[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True, name="ddl-spark-output").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            reader = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name="ddl-spark-output-rank")
            self._readers.append(reader)
            reader.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10)
                nonce = os.urandom(16)
                conn.sendall(nonce)
                hello = _recv_exact(conn, 4 + 32)
                if not hmac.compare_digest(hello[4:], _mac(self._secret, nonce, hello[:4])):
                    return  # not one of this job's tasks: read nothing
                conn.settimeout(None)
                rank = int.from_bytes(hello[:4], "big")
                for line in iter(conn.makefile("rb").readline, b""):
                    self._write(rank, line)
            except OSError:
                return

    def _write(self, rank: int, line: bytes) -> None:
        """One framed line: its stream's tag byte, then the line with its newline."""
        name, dest = ("stderr", self._err) if line[:1] == b"e" else ("stdout", self._out)
        text = line[1:].decode("utf-8", errors="replace")
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") if self._timestamps else ""
        with self._lock:
            try:
                dest.write(f"{stamp}[{rank}]<{name}>:{text}")
                dest.flush()
            except (OSError, ValueError):
                pass  # the stream was closed: the rank must not block on it

    def close(self, timeout: float = 10.0) -> None:
        self._listener.close()
        deadline = time.monotonic() + timeout
        for reader in list(self._readers):
            reader.join(max(0.0, deadline - time.monotonic()))


# -- the task's side --------------------------------------------------------------------
@contextlib.contextmanager
def _output_to(sink: Tuple[str, int], secret: str, rank: int) -> Iterator[None]:
    """In a task: while the block runs, what is written to this process's stdout and
    stderr (its rank's process's too, which inherits them) goes, line by line, to the
    driver's :class:`_OutputSink`; the streams are put back after."""
    conn = _connect(sink, secret, rank)
    if conn is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    lock, saved, readers = threading.Lock(), [], []
    for fd, tag in ((1, b"o"), (2, b"e")):
        r, w = os.pipe()
        saved.append(os.dup(fd))
        os.dup2(w, fd)
        os.close(w)
        readers.append(threading.Thread(target=_send_lines, args=(r, tag, conn, lock),
                                        daemon=True, name="ddl-spark-output"))
        readers[-1].start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)  # the pipes' last writers here close: the readers end
            os.close(old)
        for reader in readers:
            reader.join(10)
        conn.close()


def _connect(sink: Tuple[str, int], secret: str, rank: int) -> Optional[socket.socket]:
    """A connection to the driver's sink that proved the job secret, or None (said on
    this executor's stderr) when the driver cannot be reached."""
    try:
        conn = socket.create_connection(sink, timeout=10)
        nonce = _recv_exact(conn, 16)
        tag = rank.to_bytes(4, "big")
        conn.sendall(tag + _mac(secret, nonce, tag))
        conn.settimeout(None)
        return conn
    except OSError as exc:
        print(f"ddl.spark.run: rank {rank} could not reach the driver at "
              f"{sink[0]}:{sink[1]} for its output ({exc}); it stays in this executor's "
              f"log", file=sys.stderr, flush=True)
        return None


def _send_lines(fd: int, tag: bytes, conn: socket.socket, lock: threading.Lock) -> None:
    """Send each line read from ``fd`` as ``tag + line``, to the pipe's end; after a send
    failed, read on so the writers never block."""
    sending = True
    with os.fdopen(fd, "rb") as pipe:
        for line in iter(pipe.readline, b""):
            if not sending:
                continue
            try:
                with lock:
                    conn.sendall(tag + (line if line.endswith(b"\n") else line + b"\n"))
            except OSError:
                sending = False


def _rank_task(payload: bytes, secret: str, size: int, start_timeout: float,
               env: Mapping[str, str], sink: Tuple[str, int]):
    """What each barrier task runs (on an executor): this task's rank, to its end."""

    def run_partition(_):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        port = engine_ranks.free_port() if rank == 0 else 0
        every = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
        with _output_to(sink, secret, rank):
            row = engine_ranks.run_rank(payload, rank, size, secret,
                                        f"{every[0]['host']}:{every[0]['port']}",
                                        start_timeout, env)
        return [row]

    return run_partition


# -- the driver ---------------------------------------------------------------------------
def _run_stage(sc: Any, task: Callable, num_proc: int, start_timeout: float) -> List[Any]:
    """Run ``task`` as a barrier stage of ``num_proc`` tasks in a job group of its own:
    its rows; if the tasks have not started within ``start_timeout`` (or the wait is
    interrupted), the job is cancelled before this raises."""
    from pyspark import InheritableThread
    group = f"ddl.spark.run-{secrets.token_hex(6)}"
    box: dict = {}

    def collect() -> None:
        try:
            sc.setJobGroup(group, f"ddl.spark.run: {num_proc} ranks", interruptOnCancel=True)
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            box["rows"] = rdd.collect()
        except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread
            box["error"] = exc

    thread = InheritableThread(collect, daemon=True)
    thread.start()
    try:
        if not _started(sc, group, thread, start_timeout):
            raise _not_started(sc, num_proc, start_timeout)
        thread.join()
    finally:
        if thread.is_alive():
            sc.cancelJobGroup(group)
            thread.join(60)
    if "error" in box:
        raise box["error"]
    return box["rows"]


def _started(sc: Any, group: str, thread: threading.Thread, start_timeout: float) -> bool:
    """Whether the stage's tasks started (or the job ended) within ``start_timeout``."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + start_timeout
    while True:
        if not thread.is_alive() or _tasks_began(tracker, group):
            return True
        if time.monotonic() >= deadline:
            return False
        thread.join(_POLL_S)


def _tasks_began(tracker: Any, group: str) -> bool:
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in (info.stageIds if info else ()):
            s = tracker.getStageInfo(stage)
            if s and s.numActiveTasks + s.numCompletedTasks + s.numFailedTasks > 0:
                return True
    return False


def _slots(sc: Any) -> int:
    """How many tasks Spark can run at once now (its executors' cores / task CPUs)."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(
            jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - a private Spark call: estimate instead
        return int(sc.defaultParallelism)


def _not_started(sc: Any, num_proc: int, start_timeout: float) -> DDLTimeoutError:
    slots = _slots(sc)
    why = (f"Spark can run only {slots} tasks at once (master {sc.master})"
           if slots < num_proc else
           f"Spark has {slots} task slots (master {sc.master}) but others' tasks hold them, "
           f"or its executors have not come")
    return DDLTimeoutError(
        f"ddl.spark.run: the {num_proc} tasks of the barrier stage did not start within "
        f"start_timeout {start_timeout:g} s: a barrier stage starts all num_proc="
        f"{num_proc} tasks at once, and {why}; run with num_proc <= {slots}, give Spark "
        f"more executor cores (local[N], spark.executor.instances, spark.executor.cores), "
        f"or raise start_timeout if executors come on demand. The Spark job was cancelled; "
        f"no rank started", op="ddl.spark.run", timeout=float(start_timeout),
        cause=f"num_proc {num_proc} > {slots} task slots" if slots < num_proc else
        "task slots busy")


def run(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
        stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None, verbose: int = 1,
        nics=None, prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None, *, spark_context=None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks (default: the context's
    default parallelism) as one ddl job; return the results in rank order (see the
    module doc). ``start_timeout`` (default 60 s) bounds the wait for the stage's tasks
    to start (:class:`ddl.DDLTimeoutError` after it), then the ranks' start; ``env`` adds
    variables to the ranks' environment; the ranks' output goes to ``stdout`` and
    ``stderr`` (default ``sys.stdout``/``sys.stderr``), each line prefixed with its rank
    (and the time, with ``prefix_output_with_timestamp``); ``spark_context`` defaults to
    the active one (``SparkContext.getOrCreate()``).

    The signature is ``horovod.spark.run``'s. Its ``use_gloo``, ``extra_mpi_args``,
    ``verbose``, ``nics`` and ``executable`` are accepted and change nothing (each rank
    is started by its task); ``use_mpi=True`` is refused: no MPI runs here."""
    if use_mpi:
        raise ValueError("ddl.spark.run: use_mpi=True asks for mpirun, but ddl starts each "
                         "rank from its Spark task and needs no MPI; leave use_mpi unset")
    start_timeout = 60.0 if start_timeout is None else start_timeout
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) \
            or not start_timeout > 0:
        raise ValueError(f"ddl.spark.run: start_timeout must be a number of seconds > 0, "
                         f"got {start_timeout!r}")
    from pyspark import SparkContext
    sc = spark_context or SparkContext.getOrCreate()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"ddl.spark.run: num_proc must be an int >= 1, got {num_proc!r}")
    secret = secrets.token_hex(32)
    sink = _OutputSink(sc, secret, sys.stdout if stdout is None else stdout,
                       sys.stderr if stderr is None else stderr, prefix_output_with_timestamp)
    try:
        task = _rank_task(engine_ranks.pickle_call(fn, args, kwargs), secret, num_proc,
                          float(start_timeout), dict(env or {}), sink.address)
        rows = _run_stage(sc, task, num_proc, float(start_timeout))
    finally:
        sink.close()
    return engine_ranks.results(rows, num_proc, "ddl.spark.run")
