"""An elastic training program for the tests (run under ``ddlrun --min-np ...``).

Each step allreduces (sum) ``data(step, rank)``, a vector that depends on the step and
the rank, and adds it to ``w``; the state (``w``, the step, the schedule of world sizes)
is committed every step, so a reference computed from the committed schedule checks
that nothing after the last commit survived a change and nothing before it was lost.

Environment: ``STEPS`` (default 16); ``EVENTS``: ``worker:step:action`` items, comma
separated (a step of ``STEPS``: after training), where action is a signal name (the
worker sends it to itself before that step; ``SIGKILL+held``: a forked child holds the
worker's sockets open for 2 s after), ``raise`` (the worker raises an exception
there, and takes 0.5 s to exit after ddl's shutdown), ``coordinator=<signal>`` (the
worker sends it to the coordinator daemon it started for this world, once) or
``hosts=<text>`` (rank 0 of the world writes ``<text>``, ``;`` for newlines, to
``HOSTS_FILE``, once); ``STEP_SLEEP`` seconds per step (default 0.05); ``FORGE``: a
worker that first dials the rendezvous with a wrong secret, then junk;
``LATE_START=<worker>:<seconds>``: workers numbered from ``<worker>`` on wait that long
before ``ddl.init()``; ``END_SLEEP``: seconds every worker waits after its training
function returned, before it exits; ``CUPY=1``: the allreduce's input is a CuPy array on
GPU ``local_rank % device count`` of each world (the device data plane); ``SLOW_UNWIND``:
seconds the first world's training loop takes to let go when it fails (as a ``tf.data``
iterator can). At the end each worker prints one JSON line.
"""

import atexit
import json
import os
import signal
import socket
import time

import numpy as np

import ddl
import ddl.elastic
from ddl.runtime import runtime as _runtime

STEPS = int(os.environ.get("STEPS", "16"))
ME = int(os.environ["DDL_ELASTIC_WORKER"])
SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
CUPY = os.environ.get("CUPY") == "1"
EVENTS = [e.split(":", 2) for e in os.environ.get("EVENTS", "").split(",") if e]
SLOW_UNWIND = float(os.environ.get("SLOW_UNWIND", "0"))


class SlowToEnd:
    """An iterator of one item whose end takes ``seconds`` (a ``tf.data`` iterator ended
    on the way out of a failing training function waits for its autotuning thread)."""

    def __init__(self, seconds: float):
        self.seconds, self.left = seconds, 1

    def __iter__(self):
        return self

    def __next__(self):
        if not self.left:
            raise StopIteration
        self.left -= 1

    def __del__(self):
        time.sleep(self.seconds)


def data(step: int, rank: int) -> np.ndarray:
    return np.arange(4, dtype=np.float64) * (step + 1) + 10.0 * rank


def on_device(x: np.ndarray):
    if not CUPY:
        return x
    import cupy
    with cupy.cuda.Device(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount()):
        return cupy.asarray(x)


def forge() -> str:
    """Dial the elastic rendezvous with a wrong secret, and once with junk."""
    from ddl.core import json_link
    from ddl.dataplane.transports import _handshake
    host, _, port = os.environ["DDL_ELASTIC_ADDR"].rpartition(":")
    outcomes = []
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            _handshake.client(s, b"\x01" * 32, _handshake.job_id_bytes(
                json_link.elastic_job_key(os.environ["DDL_JOB_ID"])), 7, 1 << 30,
                time.monotonic() + 5, "rendezvous")
            outcomes.append("accepted")
        except ddl.HandshakeError:
            outcomes.append("refused")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
        s.settimeout(5)
        try:
            outcomes.append("closed" if s.recv(100) in (b"", b"\0") else "answered")
        except OSError:
            outcomes.append("closed")
    return ",".join(outcomes)


LATE_FROM, _, LATE_S = os.environ.get("LATE_START", "").partition(":")
if LATE_FROM and ME >= int(LATE_FROM):
    time.sleep(float(LATE_S))
ddl.init()
forged = forge() if os.environ.get("FORGE") == str(ME) else ""
state = ddl.elastic.ObjectState(step=0, w=np.zeros(4), schedule=[], resumed=[])
done_events = set()
left_at = {}


@ddl.elastic.run
def train(state):
    if state.schedule:  # a new world: when it got going again
        state.resumed.append([time.time(), ddl.size()])
    for _ in SlowToEnd(0 if state.resumed else SLOW_UNWIND):
        steps(state)


def steps(state):
    while state.step < STEPS:
        events(state.step)
        g = ddl.allreduce(on_device(data(state.step, ddl.rank())), name="grad", op=ddl.Sum)
        state.w = state.w + (g.get() if CUPY else g)
        state.schedule.append(ddl.size())
        state.step += 1
        time.sleep(SLEEP)
        state.commit()


def events(now: int) -> None:
    """The events of step ``now`` (``STEPS``: after training, before END_SLEEP)."""
    for i, (worker, step, action) in enumerate(EVENTS):
        if int(step) != now or i in done_events:
            continue
        if action.startswith("hosts=") and ddl.rank() == 0:
            done_events.add(i)
            with open(os.environ["HOSTS_FILE"], "w") as f:
                f.write(action[len("hosts="):].replace(";", "\n") + "\n")
        elif int(worker) == ME and action.startswith("coordinator="):
            done_events.add(i)  # once: the world it ends rolls back to this step
            coordinator = _runtime.runtime()._start.coordinator
            os.kill(coordinator.proc.pid, getattr(signal, action.partition("=")[2]))
            time.sleep(1.0)  # the ranks it served hear first; mine would, too
        elif int(worker) == ME and not action.startswith("hosts="):
            print(json.dumps({"worker": ME, "event": action, "at": time.time()}),
                  flush=True)
            if action == "raise":   # leaves after ddl has said goodbye, slowly
                atexit.register(time.sleep, 0.5)
                raise RuntimeError(f"worker {ME} fails before step {step}")
            if action.endswith("+held") and os.fork() == 0:
                # a child holds this worker's sockets open for 2 s, so that the leader
                # does not see its stream close: its coordinator's parent-death signal
                # comes first
                time.sleep(2.0)
                os._exit(0)
            os.kill(os.getpid(), getattr(signal, action.removesuffix("+held")))


def device_paths() -> list:
    """The device plans' paths of this world (CUPY=1)."""
    from ddl.runtime import runtime as _runtime
    return sorted({p.path for p in _runtime.runtime().backends.plane.device_plans.values()})


train(state)
events(STEPS)
time.sleep(float(os.environ.get("END_SLEEP", "0")))
print(json.dumps({"device": device_paths() if CUPY else [], "worker": ME, "rank": ddl.rank(), "size": ddl.size(),
                  "host": os.environ.get("DDL_HOSTNAME"), "w": state.w.tolist(),
                  "schedule": state.schedule, "resumed": state.resumed,
                  "forged": forged}), flush=True)
