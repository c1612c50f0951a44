"""The README's commands are true: its quick start and single-process line run here."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_quick_start_names_the_two_make_targets_and_ci_uses_the_same_test_command():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    assert "make demo" in quick and "make test" in quick
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()
    dry = subprocess.run(["make", "-n", "-W", "pyproject.toml", "demo"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30).stdout
    assert "ddlrun -np 4" in dry and "examples/numpy_allreduce.py" in dry, dry


@pytest.mark.timeout(90)
def test_demo_command_prints_a_correct_line_per_rank():
    out = subprocess.run(["ddlrun", "-np", "4", sys.executable, "examples/numpy_allreduce.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [l for l in out.stdout.splitlines() if l.endswith("-> OK")]
    assert sorted(l[:3] for l in lines) == ["[0]", "[1]", "[2]", "[3]"], out.stdout
    assert all("sum=[6.0, 6.0, 6.0, 6.0]" in l for l in lines)


@pytest.mark.timeout(60)
def test_single_process_line_runs_without_a_launcher():
    line = re.search(r'^python -c "(.+)"$', README, re.M).group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    out = subprocess.run([sys.executable, "-c", line], capture_output=True, text=True,
                         timeout=50, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1. 1. 1.]"
