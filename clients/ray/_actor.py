"""What both Ray executors share: the actor that runs a rank or an elastic worker as a
fresh process (:mod:`ddl.launcher.engine_ranks`), the job secret sealed for it, the
settings (see :mod:`ddl.ray`), and :func:`log`, the way rank 0 sends values to the
driver's ``callbacks``.

The log channel (Horovod's ``ray_logger``): each actor listens on a loopback port while
its rank runs and names it, with a fresh token, to its rank's process in ``DDLRAY_LOG``;
:func:`log` sends the token and one JSON line per value there and waits for the actor's
acknowledgement, and the actor puts each value, in order, on the
``ray.util.queue.Queue`` of the call running (that the driver reads and hands to every
callback), or drops it when the call has no callbacks. A connection without the token
is dropped unread; JSON, never pickle; nothing listens beyond loopback, and nothing is
left on disk.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from ddl import RunError
from ddl._client_api import engine_ranks

_HKDF_INFO = b"ddl-ray-job-secret"
# not DDL_*: ddl's configuration refuses variables it does not define
LOG_VAR = "DDLRAY_LOG"


def _seal(secret: str, peer_public: bytes, rank: int) -> Tuple[bytes, bytes, bytes]:
    """(driver public key, nonce, ciphertext) of ``secret`` for the actor of ``rank``."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import (X25519PrivateKey,
                                                                   X25519PublicKey)
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    mine = X25519PrivateKey.generate()
    key = _derive(mine.exchange(X25519PublicKey.from_public_bytes(peer_public)))
    nonce = os.urandom(12)
    sealed = ChaCha20Poly1305(key).encrypt(nonce, secret.encode(), b"rank %d" % rank)
    return mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), nonce, sealed


def _derive(shared: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_HKDF_INFO).derive(shared)


# -- the log channel -------------------------------------------------------------------------
def log(info: Any, chief_only: bool = True) -> None:
    """Horovod's ``horovod.ray.ray_logger.log``: send ``info`` (numbers, strings, lists,
    dicts; NumPy and torch values become lists or numbers) to the driver, where every
    callback given to ``run``/``execute`` is called with it, in the order it was sent.
    With ``chief_only`` (the default) only rank 0 sends; other ranks' calls do nothing,
    so every rank may call it. Outside a Ray job, or in a call given no callbacks, it
    does nothing. It returns once the value is on its way to the callbacks (so a call's
    values all reach that call's callbacks)."""
    if chief_only and _rank() != 0:
        return
    where = os.environ.get(LOG_VAR)
    if not where:
        return
    line = json.dumps(info, default=_plain).encode() + b"\n"
    port, token = where.split(" ", 1)
    with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as s:
        s.sendall(token.encode() + b"\n" + line)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the relay's acknowledgement: the value is queued (or dropped)


def _rank() -> int:
    import ddl
    return ddl.rank() if ddl.is_initialized() else int(os.environ.get("DDL_RANK", "0"))


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # NumPy arrays and scalars, torch tensors
        return value.tolist()
    raise TypeError(f"ddl.ray.log: {type(value).__name__} values cannot be sent as JSON; log "
                    f"numbers, strings, lists and dicts of them")


CALLBACKS_CLOSE_S = 60.0  # how long the job's end waits for the callbacks to finish


class _LogRelay:
    """In an actor, while its rank runs: the loopback port the rank's :func:`log` calls
    reach, each value put in order on ``queue`` (settable: the queue of the call running;
    None drops the values), then acknowledged; a connection that does not start with
    this relay's token is dropped unread. :meth:`close` takes what is pending first."""

    def __init__(self, queue: Any):
        self.queue = queue
        self._token = secrets.token_hex(16)
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.env = {LOG_VAR: f"{self._server.getsockname()[1]} {self._token}"}
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="ddl-ray-log-relay")
        self._thread.start()

    def _serve(self) -> None:
        self._server.settimeout(0.1)
        while True:
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                if self._closing.is_set():
                    return  # closing, and nothing is pending
                continue
            except OSError:
                return
            with conn:
                lines = self._proven_lines(conn)
                if lines is None:
                    continue  # a stranger: dropped unread, unanswered
                for line in lines:
                    try:
                        value = json.loads(line)
                    except ValueError:
                        continue  # not what log() sends: dropped
                    queue = self.queue
                    if queue is not None:
                        try:
                            queue.put(value)
                        except Exception:  # noqa: BLE001 - the driver reports a lost queue
                            pass
                try:
                    conn.sendall(b"1")
                except OSError:
                    pass  # the sender is gone

    def _proven_lines(self, conn: socket.socket) -> Optional[List[bytes]]:
        """The lines a connection sent after this relay's token (read first, and
        nothing more unless it matches); None for a stranger's, or one that failed."""
        expected = self._token.encode() + b"\n"
        conn.settimeout(5)
        got = b""
        try:
            while len(got) < len(expected):
                chunk = conn.recv(len(expected) - len(got))
                if not chunk:
                    return None
                got += chunk
            if not hmac.compare_digest(got, expected):
                return None
            conn.settimeout(30)
            return b"".join(iter(lambda: conn.recv(65536), b"")).splitlines()
        except OSError:
            return None

    def close(self) -> None:
        self._closing.set()  # what is pending is still taken
        self._thread.join(60)
        self._server.close()


class _Callbacks:
    """On the driver, for one job: the queue the actors' relays fill, read by a thread
    that calls every callback with each value. :meth:`close` (after the job ended)
    hands over what is left and removes the queue; :meth:`check` raises the first
    exception a callback raised (after which no callback is called)."""

    def __init__(self, callbacks: Sequence[Callable[[Any], Any]]):
        from ray.util.queue import Queue
        self._callbacks = list(callbacks)
        self.queue = Queue(actor_options={"num_cpus": 0})
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._pump, daemon=True,
                                        name="ddl-ray-callbacks")
        self._thread.start()

    def _pump(self) -> None:
        from ray.util.queue import Empty
        while True:
            try:
                value = self.queue.get(block=not self._done.is_set(), timeout=0.2)
            except Empty:
                if self._done.is_set():
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - the queue's actor is gone
                self._error = self._error or RuntimeError(
                    f"ddl.ray: the callbacks' queue failed ({exc!r}); later values were not "
                    f"delivered")
                return
            if self._error is None:
                try:
                    for callback in self._callbacks:
                        callback(value)
                except BaseException as exc:  # noqa: BLE001 - raised by close()
                    self._error = exc

    def close(self) -> None:
        """Hand the values left to the callbacks, then remove the queue. A callback
        still running after CALLBACKS_CLOSE_S is left behind (a RuntimeError from
        :meth:`check`), so a hung callback cannot hold the job's end."""
        self._done.set()
        self._thread.join(CALLBACKS_CLOSE_S)
        if self._thread.is_alive() and self._error is None:
            self._error = RuntimeError(
                f"a callback passed to ddl.ray was still running {CALLBACKS_CLOSE_S:g} s after "
                f"the job ended; its later values were not delivered")
        self.queue.shutdown()

    def check(self) -> None:
        """Raise the first callback's exception, if one raised."""
        if self._error is not None:
            raise self._error


def _callbacks(callbacks: Optional[Sequence[Callable[[Any], Any]]]) -> Optional[_Callbacks]:
    """A :class:`_Callbacks` for a job, or None without callbacks."""
    if callbacks is None or not list(callbacks):
        return None
    bad = [c for c in callbacks if not callable(c)]
    if bad:
        raise TypeError(f"callbacks must be callables (functions, or objects with "
                        f"__call__), got {bad[0]!r}")
    return _Callbacks(callbacks)


# -- the actor ------------------------------------------------------------------------------
class _Worker:
    """One rank's actor (made into a Ray actor class at :meth:`RayExecutor.start`).

    For :class:`RayExecutor` it keeps its rank up between calls
    (:class:`engine_ranks.RankServer`): :meth:`begin` starts the rank of a new job,
    :meth:`call` runs one call in it, :meth:`end` ends it. For
    :class:`ElasticRayExecutor`, :meth:`run_elastic` runs one worker to its end."""

    def __init__(self, rank: int):
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        self.rank = rank
        self._key = X25519PrivateKey.generate()
        self._server: Optional[engine_ranks.RankServer] = None
        self._relay: Optional[_LogRelay] = None

    def hello(self) -> Tuple[str, bytes, int, str]:
        """(this node's address, this actor's public key, pid, Ray node id)."""
        import ray
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
        public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return (ray.util.get_node_ip_address(), public, os.getpid(),
                ray.get_runtime_context().get_node_id())

    def free_port(self) -> int:
        return engine_ranks.free_port()

    def _open(self, sealed: Tuple[bytes, bytes, bytes]) -> str:
        """The job secret that :func:`_seal` sealed for this actor."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        driver_public, nonce, ciphertext = sealed
        key = _derive(self._key.exchange(X25519PublicKey.from_public_bytes(driver_public)))
        return ChaCha20Poly1305(key).decrypt(nonce, ciphertext, b"rank %d" % self.rank).decode()

    # -- a rank that stays up (RayExecutor) ------------------------------------------------
    def begin(self, size: int, rendezvous: str, sealed: Tuple[bytes, bytes, bytes],
              start_timeout: float, env: Mapping[str, str]) -> engine_ranks.Row:
        """Start rank ``self.rank`` of a new job of ``size`` (ending this actor's rank of
        the job before, if any), with the log channel open for its lifetime: its row
        once it joined (``(rank, 0, None, "")``) or failed to."""
        self.end()
        self._relay = _LogRelay(None)
        self._server = engine_ranks.RankServer(self.rank, size, self._open(sealed), rendezvous,
                                               start_timeout, dict(env, **self._relay.env))
        row = self._server.ready(start_timeout + 30)
        if row[1] or row[3]:
            self.end()
        return row

    def call(self, payload: bytes, queue: Any = None) -> engine_ranks.Row:
        """Run one call in this actor's rank: its row. What :func:`log` sends during it
        goes to ``queue`` (None: dropped)."""
        if self._server is None:
            return (self.rank, 1, None, f"rank {self.rank} is not in a job (it ended after "
                    f"a failed call, or was never started)")
        self._relay.queue = queue
        try:
            return self._server.call(payload)
        finally:
            self._relay.queue = None

    def call_result(self, payload: bytes) -> Any:
        """:meth:`call`, as ``RayExecutor.run_remote``'s references give it: the rank's
        result, or :class:`ddl.RunError` naming the rank and its error."""
        rank, code, value, tb = self.call(payload)
        if code == 0 and not tb:
            return value
        last = tb.strip().splitlines()[-1] if tb.strip() else f"it exited with code {code}"
        raise RunError(f"RayExecutor.run_remote: rank {rank} failed: {last}"
                       + (f"\nrank {rank} traceback:\n{tb.rstrip()}" if tb else ""),
                       rank=rank, exitcode=code or 1, traceback=tb)

    def alive(self) -> bool:
        """Whether this actor's rank is still in its job."""
        return self._server is not None and self._server.alive()

    def end(self) -> None:
        """End this actor's rank (it leaves its job) and its log channel."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    # -- an elastic worker (ElasticRayExecutor) --------------------------------------------
    def run_elastic(self, payload: bytes, sealed: Tuple[bytes, bytes, bytes],
                    env: Mapping[str, str], queue: Any = None) -> engine_ranks.Row:
        """Elastic worker ``self.rank`` (:class:`ElasticRayExecutor`) to its end, as a
        fresh process: ``env`` names its driver (``DDL_ELASTIC_ADDR``,
        ``DDL_ELASTIC_WORKER``, ``DDL_JOB_ID``); with ``queue``, the log channel is open
        while it runs."""
        secret = {"DDL_JOB_SECRET": self._open(sealed)}
        if queue is None:
            return engine_ranks.run_process(payload, self.rank, env, secret)
        relay = _LogRelay(queue)
        try:
            return engine_ranks.run_process(payload, self.rank, dict(env, **relay.env), secret)
        finally:
            relay.close()


# -- settings -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What :meth:`RayExecutor.create_settings` makes: ``timeout_s`` bounds the job's
    start-up (``DDL_START_TIMEOUT``), ``placement_group_timeout_s`` the wait for the
    placement group's resources."""

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0


@dataclass(frozen=True)
class ElasticSettings(Settings):
    """What :meth:`ElasticRayExecutor.create_settings` makes (Horovod's
    ``ElasticSettings``): :class:`Settings` and the elastic limits, which the executor
    takes as its defaults: ``min_num_proc`` (its ``min_workers``), ``max_num_proc``
    (``max_workers``; None: as many as the nodes have slots), ``reset_limit`` and
    ``elastic_timeout`` (seconds); ``verbose`` logs every step of the job."""

    min_num_proc: int = 1
    max_num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600.0
    verbose: bool = False


def create_settings(timeout_s: float = 30.0, ssh_identity_file: Optional[str] = None,
                    ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100.0,
                    nics: Any = None) -> Settings:
    """Horovod's ``RayExecutor.create_settings``, its arguments in its order (the ssh
    and NIC arguments mean nothing here: the actors start the ranks, which find their
    addresses themselves)."""
    _positive("create_settings", timeout_s=timeout_s,
              placement_group_timeout_s=placement_group_timeout_s)
    return Settings(float(timeout_s), float(placement_group_timeout_s))


# what Horovod's ElasticSettings takes besides the limits and means nothing here
_HOROVOD_SETTINGS = ("ssh_port", "extra_mpi_args", "tcp_flag", "binding_args", "key",
                     "start_timeout", "output_filename", "run_func_mode", "elastic",
                     "prefix_output_with_timestamp", "placement_group_timeout_s")


def create_elastic_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                            reset_limit: Optional[int] = None, elastic_timeout: float = 600,
                            timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                            nics: Any = None, min_np: Optional[int] = None,
                            max_np: Optional[int] = None, verbose: bool = False,
                            **horovod: Any) -> ElasticSettings:
    """Horovod's ``ElasticRayExecutor.create_settings``, its arguments in its order: the
    limits are kept (the executor takes its defaults from them); ``min_np``/``max_np``
    are Horovod's older names. Raises ValueError for a bad limit, TypeError for an
    argument Horovod's does not take either."""
    unknown = sorted(set(horovod) - set(_HOROVOD_SETTINGS))
    if unknown:
        raise TypeError(f"ElasticRayExecutor.create_settings: unexpected argument(s) "
                        f"{', '.join(unknown)}")
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    check_limits("ElasticRayExecutor.create_settings", min_num_proc=min_num_proc,
                 max_num_proc=max_num_proc, reset_limit=reset_limit)
    _positive("ElasticRayExecutor.create_settings", elastic_timeout=elastic_timeout,
              timeout_s=timeout_s)
    pg_timeout = float(horovod.get("placement_group_timeout_s", 100.0))
    return ElasticSettings(float(timeout_s), pg_timeout, min_num_proc, max_num_proc,
                           reset_limit, float(elastic_timeout), bool(verbose))


def check_limits(who: str, **limits: Optional[int]) -> None:
    """Each limit an int (None: unset): ``reset_limit`` >= 0, the others >= 1, and the
    first no more than the second; raises ValueError naming the argument."""
    for name, value in limits.items():
        least = 0 if name == "reset_limit" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < least):
            raise ValueError(f"{who}: {name} must be an int >= {least}, got {value!r}")
    (low_name, low), (high_name, high) = list(limits.items())[:2]
    if low is not None and high is not None and high < low:
        raise ValueError(f"{who}: {low_name} {low} > {high_name} {high}")


def _positive(who: str, **values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{who}: {name} must be a number of seconds > 0, got {value!r}")
