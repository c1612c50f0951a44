"""The framework elastic states in real 2-rank worlds without elastic (plain ``ddlrun -np
2``; one world per framework, tests/_elastic_checks.py: save, restore, sync, run, reset),
and the elastic examples: without elastic (under ``ddlrun -np 2`` and as one process), and
the PyTorch one under elastic ddlrun losing a worker mid-epoch. (The driver's own tests
are tests/test_elastic.py.)"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from test_bench import rank_lines
from test_launcher_support import assert_no_survivors, ddlrun, job_env, marked_pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "tests", "_elastic_checks.py")
EXAMPLES = os.path.join(ROOT, "examples")
JBIN = os.path.join(ROOT, ".venv-jax", "bin")


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module}")


def _env(tmp_path):
    return job_env(tmp_path, DDL_STALL_CHECK_TIME_SECONDS="15",
                   DDL_STALL_SHUTDOWN_TIME_SECONDS="60", TF_CPP_MIN_LOG_LEVEL="3")


def _checks(tmp_path, framework, python=sys.executable, launcher=None, env=None):
    args = ["-np", "2", python, CHECKS, framework]
    if launcher is None:
        r = ddlrun(args, env or _env(tmp_path), timeout=200)
    else:
        r = subprocess.run([launcher, *args], env=env, capture_output=True, text=True,
                           timeout=200, stdin=subprocess.DEVNULL, cwd=ROOT)
    assert r.returncode == 0 and "[0]<stdout>:ELASTIC CHECKS OK" in r.stdout, \
        r.stdout[-4000:] + r.stderr[-3000:]


@_needs("torch")
@pytest.mark.timeout(240)
def test_torch_state_sampler_and_object_state_in_a_two_rank_world(tmp_path):
    _checks(tmp_path, "torch")


@_needs("tensorflow")
@pytest.mark.timeout(240)
def test_keras_state_and_callbacks_in_a_two_rank_world(tmp_path):
    _checks(tmp_path, "keras")


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv-jax", ".installed")),
                    reason="the JAX environment is not there: make setup-jax")
@pytest.mark.timeout(240)
def test_jax_state_in_a_two_rank_world(tmp_path):
    env = _env(tmp_path)
    env.pop("DDL_TEST_COORDINATOR_CMD", None)
    env["PATH"] = JBIN + os.pathsep + env.get("PATH", "")
    _checks(tmp_path, "jax", os.path.join(JBIN, "python"), os.path.join(JBIN, "ddlrun"), env)


FINAL = re.compile(r"^done: (\d+) epochs, world sizes \[([\d, ]+)\], samples (\d+), "
                   r"checksum ([-\d.e+]+)$")


def _final(lines):
    found = [m for m in map(FINAL.match, lines) if m]
    assert len(found) == 1, lines
    m = found[0]
    return (int(m.group(1)), [int(s) for s in m.group(2).split(",")], int(m.group(3)),
            float(m.group(4)))


@pytest.mark.parametrize("example, module, per_epoch", [("elastic_pytorch.py", "torch", 100),
                                                        ("elastic_keras.py", "tensorflow", 96)])
@pytest.mark.timeout(300)
def test_elastic_examples_without_elastic(tmp_path, example, module, per_epoch):
    """Two ranks under plain ddlrun, then one process alone: every sample of every epoch
    trained once (the examples count them across ranks), one world each."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}")
    path = os.path.join(EXAMPLES, example)
    r = ddlrun(["-np", "2", sys.executable, path, "--epochs", "2"], _env(tmp_path),
               timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert rank_lines(r.stdout, 1) == [], "only rank 0 prints"
    epochs, sizes, samples, checksum = _final(rank_lines(r.stdout, 0))
    assert (epochs, sizes, samples) == (2, [2], 2 * per_epoch), r.stdout[-2000:]
    env = _env(tmp_path)
    alone = subprocess.run([sys.executable, path, "--epochs", "2"], env=env,
                           capture_output=True, text=True, timeout=200,
                           stdin=subprocess.DEVNULL)
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-3000:]
    epochs, sizes, samples, checksum = _final(alone.stdout.splitlines())
    assert (epochs, sizes, samples) == (2, [1], 2 * per_epoch), alone.stdout[-2000:]


def _worker_pid(marker: str, worker: int) -> int:
    """The pid of elastic worker ``worker`` of the job marked ``marker``."""
    needle = f"DDL_ELASTIC_WORKER={worker}".encode()
    for pid in marked_pids(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no live worker {worker} in job {marker}")


def _run_killing(env, example_args, kill_worker: int, after: str):
    """An elastic ddlrun of 3 workers over two simulated hosts (``--min-np 2 --max-np
    4``); once rank 0 printed ``after``, worker ``kill_worker`` is killed. Returns the
    output lines and the error lines."""
    cmd = [sys.executable, "-m", "ddl.launcher.cli", "-H", "localhost:2,127.0.0.1:1",
           "--min-np", "2", "--max-np", "4", sys.executable] + example_args
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    lines, err = [], []
    seen = threading.Event()

    def read(stream, into, signal_on=None):
        for line in stream:
            into.append(line.rstrip("\n"))
            if signal_on and line.startswith(signal_on):
                seen.set()

    readers = [threading.Thread(target=read, args=(proc.stdout, lines, "[0]<stdout>:" + after),
                                daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err), daemon=True)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 150
        while not seen.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
            pass
        assert seen.is_set(), "\n".join(lines[-20:] + err[-30:])
        # into the next epoch: rank 0 prints just before the epoch's last commit (the
        # test passes whenever the kill lands; it lands mid-epoch most often this way)
        time.sleep(0.4)
        os.kill(_worker_pid(env["DDL_TEST_MARKER"], kill_worker), signal.SIGKILL)
        assert proc.wait(180) == 0, "\n".join(lines[-20:] + err[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(10)
    assert_no_survivors(env["DDL_TEST_MARKER"])
    return lines, err


@_needs("torch")
@pytest.mark.timeout(240)
def test_pytorch_example_loses_a_worker_mid_epoch_and_trains_every_sample_once(tmp_path):
    """Elastic ddlrun over two simulated hosts (3 workers); once rank 0 printed its second
    epoch, worker 1 (on rank 0's host; it started no coordinator) is killed: the other two
    roll back to their last commit, carry on in a world of 2, and in the end every sample
    of every epoch was trained exactly once (the count kept in the committed state), in
    worlds of 3 then 2. (A commit every batch: the rollback lands mid-epoch, with the lost
    worker's share of the epoch's processed samples to keep, unless the kill comes in an
    epoch's first batch. With a sampler that records only its own rank's batches, as
    Horovod's once did, those samples are trained twice; with one that takes the union of
    the survivors' commits, a step they rolled back to differently is skipped.)"""
    env = _env(tmp_path)
    lines, err = _run_killing(env, [os.path.join(EXAMPLES, "elastic_pytorch.py"),
                                    "--epochs", "8", "--samples", "240", "--commit-every",
                                    "1", "--sleep", "0.05"], 1, "epoch 2:")
    epochs, sizes, samples, _ = _final(rank_lines("\n".join(lines), 0))
    assert (epochs, sizes, samples) == (8, [3, 2], 8 * 240), "\n".join(lines[-20:] + err[-40:])
    log = "\n".join(err)
    assert re.search(r"ddl\.elastic: PeerLostError: rank 1 .* rolling back to the last commit",
                     log), log[-3000:]


@_needs("tensorflow")
@pytest.mark.timeout(300)
def test_keras_example_loses_the_worker_that_started_a_coordinator(tmp_path):
    """The Keras example under the same elastic ddlrun; the worker killed is the only one
    on 127.0.0.1, whose process started that host's coordinator: the two on localhost
    go on in a world of 2 from their last commit (fit() with the elastic callbacks),
    and nothing is left behind, that coordinator's directory included. Keras drops the
    tail of an epoch that cannot fill a batch on every rank (at most 15 samples here)."""
    env = _env(tmp_path)
    lines, err = _run_killing(env, [os.path.join(EXAMPLES, "elastic_keras.py"),
                                    "--epochs", "6", "--samples", "96", "--commit-every",
                                    "1", "--sleep", "0.05"], 2, "epoch 1:")
    epochs, sizes, samples, _ = _final(rank_lines("\n".join(lines), 0))
    assert (epochs, sizes) == (6, [3, 2]), "\n".join(lines[-20:] + err[-40:])
    assert 6 * 96 - 16 < samples <= 6 * 96, samples
    log = "\n".join(err)
    assert "ddlrun: world 1: 2 workers (0@localhost, 1@localhost)" in log, log[-3000:]
