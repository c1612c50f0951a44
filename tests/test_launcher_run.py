"""ddl.run: a function on N local ranks under a real coordinator, results in rank order."""

from __future__ import annotations

import os

import pytest

from ddl.launcher import RunError, run
from test_launcher_support import have_daemon, stand_in_cmd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _coordinator(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("DDL_"):
            monkeypatch.delenv(name)
    if not have_daemon():
        monkeypatch.setenv("DDL_TEST_COORDINATOR_CMD", stand_in_cmd(tmp_path))


def test_results_in_rank_order_with_args_and_env():
    def fn(a, *, b):
        return os.environ["DDL_RANK"], os.environ["DDL_SIZE"], a + b, os.environ["EXTRA"]

    assert run(fn, args=(1,), kwargs={"b": 2}, np=3, env={"EXTRA": "x"}) == [
        ("0", "3", 3, "x"), ("1", "3", 3, "x"), ("2", "3", 3, "x")]


def test_output_is_forwarded_with_prefixes(capfd):
    def fn():
        import sys
        print("hi from", os.environ["DDL_RANK"])
        print("warn", os.environ["DDL_RANK"], file=sys.stderr)

    assert run(fn, np=2) == [None, None]
    out, err = capfd.readouterr()
    assert "[0]<stdout>:hi from 0" in out and "[1]<stdout>:hi from 1" in out
    assert "[1]<stderr>:warn 1" in err


def test_failing_rank_raises_run_error():
    def fn():
        if os.environ["DDL_RANK"] == "1":
            raise ValueError("boom on rank 1")
        return "ok"

    with pytest.raises(RunError) as info:
        run(fn, np=2)
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert "rank 1 (pid" in str(err) and "ValueError: boom on rank 1" in str(err)
    assert "ValueError: boom on rank 1" in err.traceback


def test_rank_killed_by_signal_raises_run_error():
    def fn():
        if os.environ["DDL_RANK"] == "0":
            os.kill(os.getpid(), 9)
        import time
        time.sleep(30)

    with pytest.raises(RunError, match=r"rank 0 \(pid \d+\) was killed by signal 9") as info:
        run(fn, np=2)
    assert info.value.rank == 0 and info.value.exitcode == 137


@pytest.mark.parametrize("np", [0, -1, 1.5, True])
def test_bad_np(np):
    with pytest.raises(ValueError, match="np must be an int >= 1"):
        run(lambda: None, np=np)


def test_horovod_run_keywords(tmp_path):
    """``import ddl as horovod``: horovod.run's keywords, as upstream examples pass them
    (``np``/``num_proc``, ``hosts`` of this machine, the controller flags), run the job;
    what ddl.run cannot do says what to use instead, before anything starts."""
    import sys

    def fn():
        return os.environ["DDL_RANK"]

    out = tmp_path / "logs"
    assert run(fn, num_proc=2, hosts="localhost:2", use_gloo=True, use_mpi=False,
               executable=sys.executable, verbose=2, output_filename=str(out),
               network_interface="lo", disable_cache=True, slots=2, max_np=2,
               reset_limit=1) == ["0", "1"]
    assert sorted(p.name for p in out.iterdir()) == ["rank.0", "rank.1"]
    for kwargs, message in (
            ({"np": 2, "num_proc": 3}, "np=2 and num_proc=3 disagree"),
            ({"np": 3, "hosts": "localhost:2"}, "has 2 slot"),
            ({"np": 1, "hosts": "h9:1"}, "names h9, not this machine; ddl.run starts its "
                                         "ranks on this machine only"),
            ({"np": 1, "hosts": "localhost:1", "hostfile": "f"}, "hosts or hostfile"),
            ({"np": 1, "use_mpi": True}, "use_mpi=True asks for mpirun"),
            ({"np": 1, "min_num_proc": 1, "reset_limit": 2},
             "min_num_proc make an elastic job")):
        with pytest.raises(ValueError, match=message):
            run(fn, **kwargs)
