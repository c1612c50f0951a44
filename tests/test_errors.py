"""Bad input: each case gets a clear error on every rank involved, and the job goes on.

Mismatches across ranks (``_error_checks.check_mismatches``) run in the hierarchical
world of test_contract.py."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest


@pytest.mark.timeout(60)
def test_calls_before_init_name_the_fix():
    code = textwrap.dedent("""
        import numpy as np, ddl
        for call in (lambda: ddl.allreduce(np.ones(1)), ddl.rank, ddl.size, ddl.barrier):
            try:
                call()
            except ddl.NotInitializedError as e:
                assert str(e) == "ddl is not initialized; call ddl.init() first", str(e)
            else:
                raise SystemExit("no error before init")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _ddlrun(tmp_path, np_: int, source: str, **env: str) -> subprocess.CompletedProcess:
    """``ddlrun -np np_`` of a script with ``source`` (dedented), with ``env`` added."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(["ddlrun", "-np", str(np_), sys.executable, str(script)],
                          capture_output=True, text=True, timeout=80,
                          env={**os.environ, **env})


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_mid_job_fails_the_others_by_name(tmp_path):
    t0 = time.monotonic()
    out = _ddlrun(tmp_path, 3, """
        import os, sys, time, numpy as np, ddl
        ddl.init()
        ddl.allreduce(np.ones(4), name="warmup")
        if ddl.rank() == 1:
            os._exit(0)          # leaves without a goodbye, with exit code 0
        t0 = time.monotonic()
        try:
            ddl.allreduce(np.ones(1 << 20), name="after")
        except ddl.PeerLostError as e:
            print(f"rank {ddl.rank()} caught PeerLostError after {time.monotonic()-t0:.2f}s: {e}")
            sys.exit(7)
        print("no error"); sys.exit(0)
    """)
    elapsed = time.monotonic() - t0
    assert out.returncode == 7, out.stdout + out.stderr
    caught = [l for l in out.stdout.splitlines() if "caught PeerLostError" in l]
    assert caught, out.stdout + out.stderr
    for line in caught:
        assert "rank 1" in line.split(": ", 1)[1], line
        assert float(line.split("after ")[1].split("s:")[0]) < 10, line
    assert elapsed < 40, elapsed


@pytest.mark.timeout(90)
def test_every_rank_exiting_with_calls_in_flight_fails_the_job_naming_one(tmp_path):
    # each rank exits 0 with asynchronous calls never waited for: the job failed, and
    # ddlrun names a rank and why (each one records it), never the coordinator
    for _ in range(3):
        out = _ddlrun(tmp_path, 2, """
            import numpy as np, ddl
            ddl.init()
            handles = [ddl.allreduce_async(np.ones(4), name=f"a{i}") for i in range(40)]
        """)
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode != 0, out.stdout + out.stderr
        assert (last.startswith("ddlrun: rank ") and "exited with code 0 (the process exited "
                "while" in last and "without calling ddl.shutdown()" in last), out.stderr


@pytest.mark.timeout(90)
def test_a_rank_that_shuts_down_while_needed_is_named_with_why(tmp_path):
    # rank 1 shuts down (its process goes on) while rank 0 waits for it in an allreduce:
    # rank 0 fails, ddlrun names rank 1 and why, and exits with rank 0's code, not the
    # signal its own teardown gave rank 1
    out = _ddlrun(tmp_path, 2, """
        import time, numpy as np, ddl
        ddl.init()
        ddl.allreduce(np.ones(4), name="warm")
        if ddl.rank() == 1:
            ddl.shutdown()
            time.sleep(30)
        ddl.allreduce(np.ones(4), name="lonely")
    """)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1, out.stderr
    assert re.fullmatch(r"ddlrun: rank 1 \(pid \d+\) was lost: it called ddl.shutdown\(\); "
                        r"the job was stopped", last), out.stderr


def _join_while_a_rank_leaves():
    import numpy as np
    import ddl
    ddl.allreduce(np.ones(1), name="warm")
    if ddl.rank() == 2:
        ddl.allreduce(np.ones(1), name="alone")  # completes once the others have joined
        ddl.shutdown()  # leaves without joining, and its process goes on a while
        time.sleep(3)
        return "left"
    try:
        ddl.join(timeout=20)
    except ddl.PeerLostError as e:
        return f"{type(e).__name__} rank {e.rank}: {e}"
    return "join returned"


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_without_joining_fails_the_others_join():
    """The ranks waiting in join() raise PeerLostError naming the rank that left and the
    join, at once (not when join's timeout runs out, or the rank's process ends)."""
    import ddl
    got = ddl.run(_join_while_a_rank_leaves, np=3)
    assert got[2] == "left"
    for line in got[:2]:
        assert line.startswith("PeerLostError rank 2: join 'join': rank 2 (host "), got
        assert line.endswith(") has shut down"), got


@pytest.mark.timeout(120)
def test_ddl_run_from_a_process_with_live_grpc_state():
    """ddl.run after this process ran its own job: children must not be forked with the
    parent's gRPC poller (grpc/grpc PR #43157 aborts such children before exec)."""
    code = textwrap.dedent("""
        import numpy as np, ddl
        ddl.init()                                   # embedded coordinator: live gRPC
        assert ddl.allreduce(np.ones(2), name="x")[0] == 1.0
        for _ in range(3):
            assert ddl.run(lambda: ddl.allreduce(np.ones(1), op=ddl.Sum, name="y")[0],
                           np=3) == [3.0, 3.0, 3.0]
        ddl.shutdown()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


@pytest.mark.timeout(90)
def test_groups_of_other_lengths_are_a_mismatch_at_once(tmp_path):
    # a group (or pytree) of 3 arrays on rank 0 and of 2 on rank 1: each rank raises
    # MismatchError at once naming both lengths (not a stall until the stall timeout while
    # rank 0's third array waits for a call rank 1 never makes), rank 0's third array
    # fails with its call (Request.call_id), so the same call retried right away runs, and
    # nothing is left to stall; the same for a group cached by three calls, then shortened
    # on rank 1 (its other names leave the cache on both ranks); so does a sparse tensor
    # against a dense one fail at once
    out = _ddlrun(tmp_path, 2, """
        import sys, time, numpy as np, ddl
        ddl.init()
        for call in ("list", "dict", "cached", "keys"):
            for _ in range(3 if call == "cached" else 0):
                assert ddl.allreduce([np.ones(2)] * 3, name=call, op=ddl.Sum)[2][0] == 2
            # (a part that paired with the retry below would add its 10s to the sum)
            xs = [np.full(2, 10.0)] * (3 - ddl.rank())
            x = xs if call != "dict" else {f"k{i}": a for i, a in enumerate(xs)}
            if call == "keys":   # as many arrays, other keys: k0, k1 against k0, k2
                x = {"k0": xs[0], f"k{1 + ddl.rank()}": xs[0]}
            t0 = time.monotonic()
            try:
                ddl.allreduce(x, name=call, op=ddl.Sum)  # cached: stale by its length only
                print("no error"); sys.exit(1)
            except ddl.MismatchError as e:
                print(f"rank {ddl.rank()} {call} after {time.monotonic() - t0:.1f}s: {e}")
            xs = [np.ones(2)] * 3
            x = xs if call not in ("dict", "keys") else {f"k{i}": a for i, a in enumerate(xs)}
            out = ddl.allreduce(x, name=call, op=ddl.Sum)  # retried at once: runs
            assert out[2 if isinstance(out, list) else "k2"][0] == 2
        # a sparse torch tensor on one rank, a dense one on the other: the same
        import torch, ddl.torch as hvd
        t0 = time.monotonic()
        try:
            if ddl.rank() == 0:
                hvd.synchronize(hvd.sparse_allreduce_async(
                    torch.sparse_coo_tensor([[0]], [1.0], (3,)), name="mixed"))
            else:
                hvd.allreduce(torch.ones(3), name="mixed")
            print("no error"); sys.exit(1)
        except ddl.MismatchError as e:
            print(f"rank {ddl.rank()} mixed after {time.monotonic() - t0:.1f}s: {e}")
        # a sparse allreduce whose values rank 1 cannot send (complex) fails as a whole on
        # both ranks, rank 0 coming late, and the same call made again sums the new values
        def sparse(values, at):
            return torch.sparse_coo_tensor([list(range(at, at + len(values)))], values, (8,))
        for i, (mine, want) in enumerate([(None, None), ([1.0, 2.0], [1, 2, 0, 0, 0, 3, 4, 0])]):
            if ddl.rank() == 1:
                t = sparse(torch.ones(4, dtype=torch.complex64) if mine is None else
                           torch.tensor(mine), 0)
            else:
                time.sleep(0.5 - 0.5 * i)   # late, but well within the stall check time
                t = sparse(torch.tensor([10.0, 20.0] if mine is None else [3.0, 4.0]), 5)
            try:
                got = hvd.sparse_allreduce_async(t, name="sp", op=hvd.Sum).wait(10)
                assert got.to_dense().tolist() == want, got
            except ddl.InvalidRequestError as e:
                assert mine is None and "complex64" in str(e), e
                print(f"rank {ddl.rank()} sparse refused", flush=True)
        assert ddl.allreduce(np.ones(1), name="after", op=ddl.Sum)[0] == 2
        time.sleep(3.0)   # past the stall check time: no name is left waiting
        sys.exit(3)
    """, DDL_STALL_CHECK_TIME_SECONDS="2")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "stall" not in out.stderr, out.stderr
    assert out.stdout.count("sparse refused") == 2, out.stdout
    lines = [line for line in out.stdout.splitlines() if " after " in line]
    assert len(lines) == 10, out.stdout + out.stderr
    assert sum("allreduce 'keys/k0': group names mismatch: ranks 0 and 1 sent groups of 2 "
               "arrays whose names differ" in line for line in lines) == 2, out.stdout
    assert sum("'mixed': op mismatch: rank 0 sent allgather, rank 1 sent allreduce" in line
               for line in lines) == 2, out.stdout
    for line in lines:
        assert float(line.split(" after ")[1].split("s:")[0]) < 10, line
    for name, a, b in (("list/0", "a group of 3 arrays", "a group of 2 arrays"),
                       ("dict/k0", "a group of 3 arrays", "a group of 2 arrays"),
                       ("cached/0", "a group of 3 arrays", "a group of 2 arrays")):
        assert sum(f"allreduce '{name}': group size mismatch: rank 0 sent {a}, rank 1 sent "
                   f"{b}" in line for line in lines) == 2, out.stdout
