"""How long an elastic job takes to get going again after a change of workers.

    python examples/bench_elastic.py [--workers 4] [--repeat 3]

Runs real elastic jobs under ``ddlrun`` on two simulated hosts of this machine
(``localhost`` and ``127.0.0.1``: each has its own coordinator, TCP between them) and
times four changes:

- a rank killed (SIGKILL) mid-step: 4 -> 3 workers;
- a rank frozen (SIGSTOP) mid-step: 4 -> 3 (found by the keepalive, 1.5 s by default);
- the host of rank 0 (and of the leader coordinator) leaving the discovery list: 4 -> 2;
- a host added to the discovery list: 2 -> 4 (ddlrun runs the script every second, so
  *detected* includes up to a second of polling; this case steps every 0.1 s, not 0.02).

Each worker trains a small model (a few tensors, 1 MB in all) and commits every step.
Columns: *detected*: from the event (the kill, or the discovery file's change) until a
survivor's collective failed (or commit() raised HostsUpdatedInterrupt); *world formed*:
until the new world's ``ddl.init()`` returned; *resumed*: until the first step of the new
world completed; *steps lost*: steps the survivors redid (work after the last commit);
*model*: whether the final model equals the reference that follows the same schedule.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

STEPS = 40


def worker() -> None:
    import ddl
    import ddl.elastic

    logging.basicConfig(format="%(created).6f %(name)s %(message)s")
    logging.getLogger("ddl.elastic").setLevel(logging.INFO)  # its "forming a new world"
    me = int(os.environ["DDL_ELASTIC_WORKER"])
    event = os.environ["BENCH_EVENT"]
    ddl.init()
    shapes = [(256, 256), (256,), (64, 64), (512, 256)]
    state = ddl.elastic.ObjectState(step=0, params=[np.zeros(s) for s in shapes], log=[])
    marks: dict = {}
    state.register_reset_callbacks([lambda: marks.setdefault("formed", time.time())])

    @ddl.elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == 10 and ddl.size() == int(os.environ["BENCH_FROM"]):
                if event in ("SIGKILL", "SIGSTOP") and me == ddl.size() - 1:
                    print(json.dumps({"event_at": time.time()}), flush=True)
                    os.kill(os.getpid(), getattr(signal, event))
                if event.startswith("hosts=") and ddl.rank() == 0:
                    with open(os.environ["BENCH_HOSTS"], "w") as f:
                        f.write(event[len("hosts="):].replace(";", "\n") + "\n")
                    print(json.dumps({"event_at": time.time()}), flush=True)
            grads = ddl.grouped_allreduce(
                [np.full(s, float(ddl.rank() + state.step)) for s in shapes],
                name="grads", op=ddl.Average)
            state.params = [p - 0.01 * g for p, g in zip(state.params, grads)]
            state.log.append([state.step, ddl.size(), time.time()])
            state.step += 1
            time.sleep(float(os.environ.get("BENCH_SLEEP", "0.02")))
            state.commit()

    train(state)
    if ddl.rank() == 0:
        print(json.dumps({"log": state.log, "formed": marks.get("formed"),
                          "params": [float(p.sum()) for p in state.params]}), flush=True)


def reference(log) -> list:
    shapes = [(256, 256), (256,), (64, 64), (512, 256)]
    params = [np.zeros(s) for s in shapes]
    for step, size, _ in log:
        mean = sum(step + r for r in range(size)) / size
        params = [p - 0.01 * np.full(p.shape, mean) for p in params]
    return [float(p.sum()) for p in params]


def run_case(name: str, args, env: dict, tmp: str) -> dict:
    cmd = [sys.executable, "-m", "ddl.launcher.cli", *args, sys.executable,
           os.path.abspath(__file__), "--worker"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"{name}: ddlrun exited {done.returncode}\n{done.stderr[-3000:]}")
    event_at = result = None
    for line in done.stdout.splitlines():
        rest = line.partition("<stdout>:")[2]
        if rest.startswith("{"):
            item = json.loads(rest)
            event_at = item.get("event_at", event_at)
            result = item if "log" in item else result
    detected = min(float(line.split("<stderr>:")[1].split()[0])
                   for line in done.stderr.splitlines()
                   if "ddl.elastic" in line and ("rolling back" in line or
                                                 "forming a new world" in line))
    log = result["log"]
    first_new = next(t for step, size, t in log if size != log[0][1])
    steps_done = [step for step, _, _ in log]
    return {"case": name, "detected": detected - event_at,
            "formed": result["formed"] - event_at, "resumed": first_new - event_at,
            "lost": 0 if steps_done == list(range(STEPS)) else "?",
            "model": "equal" if np.allclose(result["params"], reference(log)) else "DIFFERS"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    tmp = tempfile.mkdtemp(prefix="ddl-bench-elastic-")
    hosts = os.path.join(tmp, "hosts")
    discover = os.path.join(tmp, "discover.sh")
    with open(discover, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(discover, 0o755)
    base = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_HOSTS=hosts)
    two_hosts = ["-H", "localhost:2,127.0.0.1:2", "--min-np", "2", "--max-np", "4"]
    by_discovery = ["--min-np", "2", "--max-np", "4", "--host-discovery-script", discover]
    cases = [
        ("rank killed, 4 -> 3", two_hosts, "SIGKILL", 4, "localhost:2;127.0.0.1:2"),
        ("rank frozen, 4 -> 3", two_hosts, "SIGSTOP", 4, "localhost:2;127.0.0.1:2"),
        ("leader's host leaves, 4 -> 2", by_discovery, "hosts=127.0.0.1:2", 4,
         "localhost:2;127.0.0.1:2"),
        ("host added, 2 -> 4", by_discovery, "hosts=localhost:2;127.0.0.1:2", 2,
         "localhost:2"),
    ]
    print(f"# elastic changes on this machine ({os.cpu_count()} cores), {STEPS} steps, "
          f"commit every step; seconds from the event; best of {args.repeat}")
    print(f"# {'change':<30} {'detected':>9} {'formed':>8} {'resumed':>8} "
          f"{'steps lost':>10} {'model':>7}")
    for name, flags, event, start, initial in cases:
        rows = []
        for _ in range(args.repeat):
            with open(hosts, "w") as f:
                f.write(initial.replace(";", "\n") + "\n")
            env = dict(base, BENCH_EVENT=event, BENCH_FROM=str(start),
                       BENCH_SLEEP="0.1" if start == 2 else "0.02")
            rows.append(run_case(name, flags, env, tmp))
        best = min(rows, key=lambda r: r["resumed"])
        print(f"  {name:<30} {best['detected']:>9.2f} {best['formed']:>8.2f} "
              f"{best['resumed']:>8.2f} {best['lost']:>10} {best['model']:>7}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
