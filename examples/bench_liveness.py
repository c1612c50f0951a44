"""How fast a frozen process fails a job, with the default liveness settings.

    python examples/bench_liveness.py [--np 3] [--repeat 5] [--what rank,coordinator]

Each trial runs ``ddlrun -np N python examples/bench_liveness.py --worker OUTDIR`` (every
rank allreduces 1 MiB in a loop and records, in OUTDIR, its pid and the moment a ddl call
raised, on ``time.monotonic()``, one clock for every process of the host), waits until
the allreduces run, then stops (SIGSTOP) rank 1 or the coordinator and measures:

* ``raise``: from the freeze until every surviving rank raised (all, for a coordinator);
* ``exit``: from the freeze until ``ddlrun`` exited.

It prints min / median / max over ``--repeat`` trials per case, and the 1-minute load
average before and after (the figures depend on how busy the machine is). The promise
(docs/failures.md): raise within 3 s, ``ddlrun`` exits within 8 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def worker(outdir: str) -> None:
    import numpy as np

    import ddl

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown must not race the record
    ddl.init()
    rank = ddl.rank()
    _write(outdir, f"{rank}.pid", {"pid": os.getpid()})
    x = np.ones(1 << 18, np.float32)
    try:
        while True:
            ddl.allreduce(x, name="x")
    except ddl.DDLError as exc:
        _write(outdir, f"{rank}.err", {"t": time.monotonic(), "type": type(exc).__name__,
                                       "message": str(exc)})
        sys.exit(1)


def _write(outdir: str, name: str, body) -> None:
    path = os.path.join(outdir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


def _read(outdir: str, name: str):
    try:
        with open(os.path.join(outdir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _coordinator_pid(launcher_pid: int) -> int:
    """The coordinator daemon ``ddlrun`` started (a child of it)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        if ppid == launcher_pid and b"ddl.server.daemon" in argv:
            return int(entry)
    raise RuntimeError("no coordinator found")


def trial(np_: int, what: str, timeout: float = 60.0):
    """One job, one freeze: (seconds until every survivor raised, until ddlrun exited,
    the first survivor's error)."""
    with tempfile.TemporaryDirectory(prefix="ddl-bench-liveness-") as outdir:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddl.launcher.cli", "-np", str(np_), sys.executable,
             os.path.abspath(__file__), "--worker", outdir], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not all(_read(outdir, f"{r}.pid") for r in range(np_)):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the job did not start")
                time.sleep(0.05)
            time.sleep(1.0)  # allreduces running
            if what == "rank":
                victim, survivors = _read(outdir, "1.pid")["pid"], [r for r in range(np_)
                                                                     if r != 1]
            else:
                victim, survivors = _coordinator_pid(proc.pid), list(range(np_))
            t_freeze = time.monotonic()
            os.kill(victim, signal.SIGSTOP)
            while not all(_read(outdir, f"{r}.err") for r in survivors):
                if time.monotonic() - t_freeze > timeout:
                    raise RuntimeError("the survivors did not raise")
                time.sleep(0.005)
            errs = [_read(outdir, f"{r}.err") for r in survivors]
            raised = max(e["t"] for e in errs) - t_freeze
            proc.wait(timeout)
            exited = time.monotonic() - t_freeze
            return raised, exited, errs[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=3, help="ranks per job (>= 2)")
    p.add_argument("--repeat", type=int, default=5, help="trials per case")
    p.add_argument("--what", default="rank,coordinator",
                   help="what to freeze: rank, coordinator or both (comma-separated)")
    p.add_argument("--worker", metavar="OUTDIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.np < 2:
        p.error("--np must be at least 2")
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    print(f"{'frozen':<12} {'n':>2}  {'raise min/median/max (s)':>26}  "
          f"{'ddlrun exit min/median/max (s)':>32}")
    for what in args.what.split(","):
        raised, exited = [], []
        first = None
        for _ in range(args.repeat):
            r, e, err = trial(args.np, what)
            raised.append(r)
            exited.append(e)
            first = first or err
        fmt = lambda xs: f"{min(xs):6.2f} {statistics.median(xs):6.2f} {max(xs):6.2f}"
        print(f"{what:<12} {args.repeat:>2}  {fmt(raised):>26}  {fmt(exited):>32}")
        print(f"  e.g. {first['type']}: {first['message'][:300]}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
