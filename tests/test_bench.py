"""ddl-bench (``ddl/bench/``): real 2-rank runs under ddlrun, and its argument checks.

The runs use tiny sizes and few iterations; each checks the output format (table, CSV,
JSON, the Gloo and MPI columns, the floors) and that every op's results were correct;
speed is never asserted. The MPI runs start the job with ``ddlrun --mpi`` or ``mpiexec``
(MPICH and mpi4py from PyPI, the dev extra). One run corrupts one rank's allreduce
results to prove a wrong result is reported and fails the job. Bad arguments are
checked in-process: ``main`` returns 2 before it starts ddl.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ddl import bench
from test_launcher_support import ddlrun, job_env, script
from test_mpi import MPIEXEC, needs_mpi

NP = 2
TINY = ["-n", "2", "-w", "1"]
ROW_FIELDS = ["op", "size", "count", "dtype", "redop", "ranks", "time_us", "min_us", "algbw_gbps",
              "busbw_gbps", "check"]
HEADER = ["op", "size(B)", "count", "dtype", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
          "check"]


def peer_fields(name: str):
    """The CSV/JSON fields --compare NAME adds."""
    return [f"{name}_time_us", f"{name}_min_us", f"{name}_algbw_gbps", f"{name}_busbw_gbps",
            f"{name}_check", f"{name}_ratio"]


HAVE_TORCH = importlib.util.find_spec("torch") is not None


def ratio_matches(ratio: str, num: str, den: str) -> bool:
    """Whether a table's ratio cell (2 decimals) is num / den of its time cells (1
    decimal), allowing for the rounding of all three."""
    n, d = float(num), float(den)
    low, high = (n - 0.05) / (d + 0.05), (n + 0.05) / max(d - 0.05, 1e-9)
    return low - 0.005 <= float(ratio) <= high + 0.005


def run_bench(tmp_path, *args: str, expect_rc: int = 0, timeout: float = 60.0):
    """``ddlrun -np 2 python -m ddl.bench ARGS``; returns (rank 0's stdout lines, result)."""
    r = ddlrun(["-np", str(NP), sys.executable, "-m", "ddl.bench", *args],
               job_env(tmp_path), timeout=timeout)
    assert r.returncode == expect_rc, f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return rank_lines(r.stdout, 0), r


def rank_lines(stdout: str, rank: int):
    """The stdout lines of one rank, without ddlrun's ``[rank]<stdout>:`` prefix."""
    prefix = f"[{rank}]<stdout>:"
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


def table_rows(lines):
    """(header cells, list of row cells) of a table: the non-comment lines."""
    body = [line.split() for line in lines if not line.startswith("#")]
    return body[0], body[1:]


def test_table_every_op_is_correct(tmp_path):
    lines, r = run_bench(tmp_path, "--op", "all", "--sizes", "4,4K", *TINY)
    header, rows = table_rows(lines)
    assert header == HEADER
    assert [row[0] for row in rows] == [op for op in bench.OPS for _ in range(2)]
    assert all(len(row) == len(header) for row in rows), lines
    assert all(row[-1] == "ok" for row in rows), lines
    sizes = {(row[0], int(row[1])) for row in rows}
    # size 4 B of float32: one element, or one per rank for the blocked ops
    assert ("allreduce", 4) in sizes and ("broadcast", 4) in sizes
    assert {("allgather", 8), ("alltoall", 8), ("reducescatter", 8)} <= sizes
    assert all(int(row[1]) == 4 * int(row[2]) for row in rows)
    assert all(float(row[4]) > 0 for row in rows)
    assert lines[0].startswith("# ddl-bench: 2 ranks, float32")
    assert lines[-1] == "# 10 rows, every result correct"
    assert not rank_lines(r.stdout, 1), "only rank 0 prints"


def test_csv_with_a_size_range(tmp_path):
    lines, _ = run_bench(tmp_path, "--op", "allreduce,alltoall", "-b", "16", "-e", "1K",
                         "-f", "8", "--dtype", "int32", "--csv", "-o", "prod", *TINY)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    assert list(rows[0]) == ROW_FIELDS
    assert [(row["op"], int(row["size"])) for row in rows] == [
        ("allreduce", 16), ("allreduce", 128), ("allreduce", 1024), ("alltoall", 16),
        ("alltoall", 128), ("alltoall", 1024)]
    for row in rows:
        assert row["check"] == "ok" and row["dtype"] == "int32" and row["ranks"] == "2"
        assert row["redop"] == ("prod" if row["op"] == "allreduce" else "")
        assert 0 < float(row["min_us"]) <= float(row["time_us"])
        factor = 1.0 if row["op"] == "allreduce" else 0.5  # 2(n-1)/n and (n-1)/n at n=2
        assert float(row["busbw_gbps"]) == pytest.approx(factor * float(row["algbw_gbps"]))


def test_json_to_a_file(tmp_path):
    path = tmp_path / "out.json"
    lines, _ = run_bench(tmp_path, "--op", "allgather,broadcast,reducescatter", "--sizes",
                         "6,64K", "--dtype", "float16", "--json", "--output", str(path),
                         "--timing", "per-call", *TINY)
    assert lines == [], "with --output nothing goes to stdout"
    rows = json.loads(path.read_text())
    assert [(row["op"], row["size"]) for row in rows] == [
        ("allgather", 4), ("allgather", 65536), ("broadcast", 6), ("broadcast", 65536),
        ("reducescatter", 4), ("reducescatter", 65536)]
    assert all(list(row) == ROW_FIELDS and row["check"] == "ok" for row in rows)
    assert all(row["count"] * 2 == row["size"] for row in rows)
    assert all(0 < row["min_us"] <= row["time_us"] for row in rows)


@pytest.mark.parametrize("reduce_op", bench.REDUCE_OPS)
def test_every_reduce_op_has_exact_expected_results(reduce_op):
    """For every dtype and rank count, each rank's input and the expected result of an
    allreduce and a reducescatter are exact in the dtype, ranks send different values,
    and a product is never zero (so a lost factor shows)."""
    for dtype in bench.DTYPES:
        for n in (1, 2, 3, 8):
            for op in bench.REDUCING_OPS:
                cases = [bench.make_case(op, 4096, dtype, r, n, reduce_op) for r in range(n)]
                exact = bench.exact_output(cases[0])
                assert np.array_equal(bench.expected_output(cases[0]).astype(np.float64),
                                      exact.astype(np.float64)), (dtype, n, op)
                inputs = [bench.make_input(c) for c in cases]
                assert all(np.array_equal(x.astype(np.float64), bench.pattern(
                    c.rank, x.size, c).astype(np.float64)) for x, c in zip(inputs, cases))
                if n > 1 and bench.pattern_modulus(dtype, n, cases[0].product) > 2:
                    assert not np.array_equal(inputs[0], inputs[1]), (dtype, n)
                if reduce_op == "prod":
                    assert exact.min() >= 1, (dtype, n, op)
                    if op == "allreduce":   # every rank's factors show in the result
                        every = [bench.pattern(k, c.count, c) for k, c in enumerate(cases)]
                        for skip in range(n):
                            rest = np.prod([v for k, v in enumerate(every) if k != skip],
                                           axis=0)
                            assert not np.array_equal(rest, exact), (dtype, n, skip)


@pytest.mark.skipif(not HAVE_TORCH, reason="--compare gloo needs torch, which is not "
                                           "importable here (pip install torch)")
def test_compare_gloo_adds_checked_columns(tmp_path):
    lines, _ = run_bench(tmp_path, "--op", "all", "--sizes", "4,4K", "--dtype", "bfloat16",
                         "--compare", "gloo", "--reduce-op", "max", *TINY, timeout=90)
    assert "; Max reductions, broadcast root 0" in lines[0], lines[0]
    header, rows = table_rows(lines)
    assert header[-3:] == ["gloo(us)", "gloo_check", "gloo/ddl"]
    assert len(rows) == 2 * len(bench.OPS)
    for row in rows:
        assert row[7] == "ok" and row[9] == "ok", lines
        ratio = float(row[10])
        assert ratio == pytest.approx(float(row[8]) / float(row[4]), rel=0.02, abs=0.01)


def test_wrong_result_is_reported_and_fails(tmp_path):
    """Rank 1 gets a corrupted allreduce result: every rank knows, the job exits 1."""
    path = script(tmp_path, "corrupt.py", """
        import sys
        import ddl
        from ddl import bench
        real_allreduce = ddl.allreduce

        def corrupted(x, *args, name=None, **kwargs):
            out = real_allreduce(x, *args, name=name, **kwargs)
            if ddl.rank() == 1 and name.startswith("ddl-bench/allreduce/"):
                out = out.copy()
                out[-1] += 1
            return out

        ddl.allreduce = corrupted
        sys.exit(bench.main(sys.argv[1:]))
    """)
    r = ddlrun(["-np", str(NP), sys.executable, path, "--op", "allreduce,broadcast",
                "--sizes", "64", *TINY], job_env(tmp_path), timeout=60)
    assert r.returncode == 1, r.stderr[-3000:]
    _, rows = table_rows(rank_lines(r.stdout, 0))
    assert [(row[0], row[-1]) for row in rows] == [("allreduce", "WRONG"),
                                                   ("broadcast", "ok")]
    assert "# 2 rows, 1 with WRONG results" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--sizes", "3X"], "invalid size '3X'"),
    (["--sizes", "0"], "invalid size '0'"),
    (["--op", "allreduce,gather"], "unknown op 'gather'"),
    (["--dtype", "complex64"], "invalid choice: 'complex64'"),
    (["--iters", "0"], "must be at least 1"),
    (["-f", "1"], "must be at least 2"),
    (["--sizes", "4", "--max-bytes", "1M"], "either --sizes or --min-bytes"),
    (["-b", "1M", "-e", "4K"], "--min-bytes (1048576) is larger than --max-bytes (4096)"),
    (["--csv", "--json"], "not allowed with argument"),
    (["--compare", "nccl"], "--compare nccl moves device memory: add --device cuda"),
    (["--compare", "gloo,x"], "unknown implementation 'x': choose from gloo, mpi, nccl"),
    (["--compare", "gloo,mpi,x"], "unknown implementation 'x'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments(args, message, capsys, monkeypatch):
    monkeypatch.delenv("DDL_RANK", raising=False)
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert "ddl-bench: error:" in err and message in err, err


def test_compare_gloo_without_torch(capsys, monkeypatch):
    monkeypatch.delenv("DDL_RANK", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    assert bench.main(["--compare", "gloo"]) == 2
    err = capsys.readouterr().err
    assert "--compare gloo needs PyTorch" in err and "pip install torch" in err, err


def test_device_cuda_needs_cupy_with_a_gpu_and_refuses_host_floors(capsys, monkeypatch):
    monkeypatch.delenv("DDL_RANK", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    assert bench.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda makes CuPy arrays" in err and "pip install cupy-cuda12x" in err, err
    assert bench.main(["--device", "cuda", "--floor"]) == 2
    assert "--floor measures host memory" in capsys.readouterr().err
    assert bench.main(["--device", "cuda", "--dtype", "bfloat16"]) == 2
    assert "CuPy has no bfloat16" in capsys.readouterr().err


def test_device_cuda_every_op_over_the_cupy_stand_in(tmp_path):
    """``--device cuda`` end to end (CuPy arrays, the device data plane, results checked
    on the host) on the CuPy stand-in of tests/standin, which makes it run without a GPU;
    its speed means nothing."""
    standin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
    env = job_env(tmp_path, PYTHONPATH=os.pathsep.join(
        p for p in (standin, os.environ.get("PYTHONPATH")) if p))
    r = ddlrun(["-np", str(NP), sys.executable, "-m", "ddl.bench", "--device", "cuda",
                "--op", "all", "--sizes", "4,1M", *TINY], env, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    lines = rank_lines(r.stdout, 0)
    assert any("inputs: CuPy arrays" in line for line in lines), lines
    assert lines[-1] == "# 10 rows, every result correct", lines


_GPUS = """
import cupy, ddl
from ddl import bench
from ddl.bench import _peers
ddl.init()
try:
    _peers._one_rank_per_gpu(ddl.local_rank() % cupy.cuda.runtime.getDeviceCount())
    print("GPUS ok", flush=True)
except bench.CompareError as exc:
    print(f"GPUS {exc}", flush=True)
ddl.shutdown()
"""


@pytest.mark.parametrize("gpus", ["1", "2"])
def test_compare_nccl_refuses_ranks_that_share_a_gpu(tmp_path, gpus):
    """``--compare nccl`` on the CuPy stand-in's GPUs: two ranks on one GPU get one
    message on both (NCCL would refuse them), a GPU each is fine. (The NCCL runs
    themselves need torch with CUDA: tests/gpu and tools/gpu_suite.sh.)"""
    standin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
    env = job_env(tmp_path, DDL_TEST_GPUS=gpus, PYTHONPATH=os.pathsep.join(
        p for p in (standin, os.environ.get("PYTHONPATH")) if p))
    r = ddlrun(["-np", "2", sys.executable, script(tmp_path, "gpus.py", _GPUS)], env,
               timeout=60)
    said = re.findall(r"GPUS (.*)", r.stdout)
    assert r.returncode == 0 and len(said) == 2, r.stdout + r.stderr[-3000:]
    if gpus == "2":
        assert said == ["ok", "ok"], said
    else:
        assert all("ranks 0 and 1 are on the same GPU" in s and "one rank per GPU" in s
                   for s in said), said


def test_compare_nccl_needs_torch_with_cuda(tmp_path):
    """With CuPy's (stand-in) GPU but a torch without CUDA, ``--compare nccl`` stops
    before starting anything, saying what is missing."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the message is for a torch without it")
    standin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (standin, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "ddl.bench", "--device", "cuda", "--compare",
                        "nccl"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--compare nccl needs PyTorch built with CUDA and NCCL" in r.stderr, r.stderr


def test_floors_in_csv(tmp_path):
    # 400K: an allreduce that the group runs as reduce_scatter, completed from the lone
    # place of the cycle's round once cached
    lines, _ = run_bench(tmp_path, "--op", "allreduce,broadcast", "--sizes", "4,64K,400K",
                         "--floor", "--csv", *TINY)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    assert list(rows[0]) == ROW_FIELDS + ["floor_kind", "floor_us", "floor_ratio"]
    assert [(row["op"], int(row["size"]), row["floor_kind"]) for row in rows] == [
        (op, size, kind) for op in ("allreduce", "broadcast")
        for size, kind in ((4, "pingpong"), (65536, "pingpong"), (409600, "copy"))]
    for row in rows:
        assert row["check"] == "ok" and float(row["floor_us"]) > 0, row
        assert float(row["floor_ratio"]) == pytest.approx(
            float(row["time_us"]) / float(row["floor_us"]))


def test_compare_mpi_without_mpi4py(capsys, monkeypatch):
    monkeypatch.delenv("DDL_RANK", raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    assert bench.main(["--compare", "mpi"]) == 2
    err = capsys.readouterr().err
    assert "--compare mpi needs mpi4py" in err and "pip install mpi4py" in err, err


# -- --compare mpi and --floor: real MPI jobs ------------------------------------------------

def _mpi_env(tmp_path) -> dict:
    """A job environment whose PATH finds mpiexec (installed beside this Python)."""
    return job_env(tmp_path, PATH=os.path.dirname(sys.executable) + os.pathsep
                   + os.environ.get("PATH", ""))


@needs_mpi
@pytest.mark.timeout(120)
def test_compare_mpi_and_the_floor_under_ddlrun_mpi(tmp_path):
    """Every op, with MPI beside ddl and the floors: the columns, every result checked,
    the ratios; the ping-pong floor at the small size, the copy floor at 256 KiB."""
    r = ddlrun(["--mpi", "-np", str(NP), sys.executable, "-m", "ddl.bench", "--op", "all",
                "--sizes", "4,256K", "--compare", "mpi", "--floor", "-o", "min", *TINY],
               _mpi_env(tmp_path), timeout=100)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}"
    lines = r.stdout.splitlines()  # mpiexec adds no rank prefix; only rank 0 prints
    assert lines[0].startswith("# ddl-bench: 2 ranks, float32"), lines
    assert any(line.startswith("# mpi: mpi4py ") for line in lines), lines
    header, rows = table_rows(lines)
    assert header == HEADER + ["mpi(us)", "mpi_check", "mpi/ddl", "floor", "floor(us)",
                               "ddl/floor"]
    assert [row[0] for row in rows] == [op for op in bench.OPS for _ in range(2)], lines
    for row in rows:
        assert len(row) == len(header) and row[7] == "ok" and row[9] == "ok", lines
        assert ratio_matches(row[10], row[8], row[4]), row
        assert row[11] == ("pingpong" if int(row[1]) <= bench.FLOOR_MIN_BYTES else "copy")
        assert float(row[12]) > 0 and ratio_matches(row[13], row[4], row[12]), row
    assert {int(row[1]) for row in rows} == {4, 8, 256 * 1024}
    assert lines[-1] == "# 10 rows, every result correct"


@needs_mpi
@pytest.mark.skipif(not HAVE_TORCH, reason="--compare gloo needs torch, which is not "
                                           "importable here (pip install torch)")
@pytest.mark.timeout(120)
def test_compare_gloo_and_mpi_under_mpiexec(tmp_path):
    r = subprocess.run([MPIEXEC, "-n", str(NP), sys.executable, "-m", "ddl.bench", "--op",
                        "allgather,broadcast", "--sizes", "4K", "--compare", "gloo,mpi",
                        "--json", *TINY], env=_mpi_env(tmp_path), capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=100)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}"
    rows = json.loads(r.stdout)
    assert [(row["op"], row["size"]) for row in rows] == [("allgather", 4096),
                                                          ("broadcast", 4096)]
    for row in rows:
        assert list(row) == ROW_FIELDS + peer_fields("gloo") + peer_fields("mpi")
        assert row["check"] == row["gloo_check"] == row["mpi_check"] == "ok", row
        assert row["mpi_ratio"] == pytest.approx(row["mpi_time_us"] / row["time_us"])


def test_compare_mpi_under_plain_ddlrun_fails_with_one_message(tmp_path):
    _, r = run_bench(tmp_path, "--compare", "mpi", "--sizes", "4", expect_rc=2)
    message = "ddl-bench: error: --compare mpi needs an MPI world"
    assert r.stderr.count(message) == 1, r.stderr
    assert "ddlrun --mpi -np N ddl-bench" in r.stderr, r.stderr


@needs_mpi
@pytest.mark.timeout(120)
def test_compare_mpi_when_the_ddl_ranks_are_not_mpi_world(tmp_path):
    """ddl started on COMM_WORLD in the reverse order: every rank stops, exit status 2."""
    path = script(tmp_path, "reversed.py", """
        import sys
        import ddl
        from ddl import bench
        ddl.init(comm=[1, 0])
        try:
            status = bench.main(sys.argv[1:])
        finally:
            ddl.shutdown()
        sys.exit(status)
    """)
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, path, "--compare", "mpi",
                        "--sizes", "4", *TINY], env=_mpi_env(tmp_path), capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=100)
    assert r.returncode == 2, f"{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stderr.count("ddl-bench: error: --compare mpi: MPI.COMM_WORLD has 2 ranks") == 1
    assert "so that they are the same ranks" in r.stderr


def test_bad_arguments_under_ddlrun_fail_the_job_with_one_message(tmp_path):
    _, r = run_bench(tmp_path, "--sizes", "1Q", expect_rc=2)
    assert r.stderr.count("ddl-bench: error: argument --sizes: invalid size '1Q'") == 1, \
        r.stderr


def test_help_says_what_size_means(capsys, monkeypatch):
    monkeypatch.delenv("DDL_RANK", raising=False)
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "nccl-tests convention: the total buffer size" in out
    assert all(op in out for op in bench.OPS) and "microseconds" in out


def test_sizes_and_busbw_factors():
    assert bench.parse_size_list("4,64K,1m,2G") == [4, 65536, 2 ** 20, 2 ** 31]
    assert bench.size_range(4, 100, 4) == [4, 16, 64]
    assert [bench.busbw_factor(op, 4) for op in bench.OPS] == [1.5, 0.75, 1.0, 0.75, 0.75]
    case = bench.make_case("alltoall", 1000, "float64", rank=0, n=3)
    assert (case.nbytes, case.count, case.block) == (984, 123, 41)


@pytest.mark.parametrize("dtype", list(bench.DTYPES))
@pytest.mark.parametrize("n", [2, 3, 64])
def test_expected_values_are_exact(dtype, n):
    """Cast to the dtype, the expected results keep their exact integer values, and the
    ranks' inputs differ (unless the dtype is too narrow for n ranks)."""
    for op in bench.OPS:
        case = bench.make_case(op, 4096, dtype, rank=n - 1, n=n)
        expected = bench.expected_output(case)
        assert expected.dtype == bench.DTYPES[dtype]
        assert np.array_equal(expected.astype(np.int64), bench.exact_output(case)), op
    if bench.pattern_modulus(dtype, n) > 1:
        assert np.all(bench.pattern(0, 1000, case) != bench.pattern(1, 1000, case))
