"""examples/cupy_allreduce.py under ``ddlrun -np 3`` on the CuPy stand-in of tests/standin
(every collective on CuPy arrays, one on a side stream, and a training loop whose
gradients stay on the device), so CI runs it without a GPU; tests/gpu runs it with the
real CuPy on a GPU."""

from __future__ import annotations

import os
import re
import sys

from test_launcher_support import ddlrun, job_env

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "cupy_allreduce.py")


def test_cupy_example_over_the_stand_in(tmp_path):
    env = job_env(tmp_path, PYTHONPATH=os.pathsep.join(
        p for p in (os.path.join(HERE, "standin"), os.environ.get("PYTHONPATH")) if p))
    r = ddlrun(["-np", "3", sys.executable, EXAMPLE, "--steps", "60"], env, timeout=90)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    done = re.findall(r"rank (\d)/3 on GPU 0: collectives OK; trained to within (\S+) of "
                      r"the true weights -> OK", r.stdout)
    assert sorted(rank for rank, _ in done) == ["0", "1", "2"], r.stdout
    assert all(float(err) < 1e-3 for _, err in done), done
