"""The timeline (ddl/runtime/timeline.py): a Chrome-trace file that is valid JSON at every moment.

Run this file directly (``python tests/test_timeline.py``) to print the per-event cost
with the timeline on and off; the tests themselves assert nothing about speed.
"""

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ddl.runtime import _trace_events, _trace_file
from ddl.runtime import timeline as _timeline
from ddl.runtime.timeline import (MEMCPY_IN_FUSION_BUFFER, MEMCPY_OUT_FUSION_BUFFER, NEGOTIATE,
                                  QUEUE, Timeline)

DDL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(_timeline.__file__)))
# Imports ddl.runtime.timeline in a fresh interpreter (argv[1]: DDL_DIR) with the packages
# ddl and ddl.runtime stood in for by empty ones, so that their __init__ (the whole public
# face) is not imported: only the timeline's modules and the standard library load.
LOAD_TIMELINE = r"""
import importlib, sys, types
for _name, _path in (("ddl", sys.argv[1]), ("ddl.runtime", sys.argv[1] + "/runtime")):
    _pkg = types.ModuleType(_name)
    _pkg.__path__ = [_path]
    sys.modules[_name] = _pkg
mod = importlib.import_module("ddl.runtime.timeline")
"""


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def load(path):
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list)
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(e), e
    return events


def rows(events):
    """tensor name -> its non-metadata events, in file order (rows named by thread_name)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out = {}
    for e in events:
        if e["ph"] != "M" and (e["pid"], e["tid"]) in names:
            out.setdefault(names[(e["pid"], e["tid"])], []).append(e)
    return out


def check_rows_well_formed(events):
    """Per row: B/E alternate (phases never nest or overlap), E closes the phase B opened,
    and begin/end timestamps strictly increase in file order."""
    for name, evs in rows(events).items():
        open_phase, last_ts = None, None
        for e in evs:
            if e["ph"] not in ("B", "E"):
                continue
            if last_ts is not None:
                assert e["ts"] > last_ts, (name, e)
            last_ts = e["ts"]
            if e["ph"] == "B":
                assert open_phase is None, (name, e)
                open_phase = e["name"]
            else:
                assert open_phase == e["name"], (name, e)
                open_phase = None


@pytest.fixture
def tl():
    timeline = Timeline()
    yield timeline
    timeline.stop()


# -- format ----------------------------------------------------------------------------

def test_lifecycle_of_a_fused_allreduce_shows_every_phase_with_its_args(tl, tmp_path):
    path = str(tmp_path / "tl.json")
    tl.start(path, pid=3)
    names = ["grad/w", "grad/b"]
    tl.begin(names, NEGOTIATE, {"op": "allreduce"}, t=10.0)
    tl.negotiate_tick("grad/w", 1, t=10.0005)
    tl.negotiate_tick("grad/w", 0, t=10.001)
    tl.begin(names, QUEUE, t=10.002)
    tl.begin(names, MEMCPY_IN_FUSION_BUFFER, t=10.003)
    tl.begin(names, "ALLREDUCE",
             {"algorithm": "ring", "transport": "shm", "bytes": np.int64(4096)}, t=10.004)
    tl.begin(names, MEMCPY_OUT_FUSION_BUFFER, t=10.005)
    tl.end(names, t=10.006)
    tl.stop()
    assert not tl.active and tl.path is None

    events = load(path)
    assert events[0] == {"name": "process_name", "ph": "M", "ts": events[0]["ts"], "pid": 3,
                         "tid": 0, "args": {"name": "rank 3"}}
    assert all(e["pid"] == 3 for e in events)
    check_rows_well_formed(events)
    by_row = rows(events)
    assert set(by_row) == {"grad/w", "grad/b"}
    tids = {e["tid"] for e in by_row["grad/w"]} | {e["tid"] for e in by_row["grad/b"]}
    assert len(tids) == 2 and 0 not in tids  # one Chrome thread per tensor
    phases = [NEGOTIATE, QUEUE, MEMCPY_IN_FUSION_BUFFER, "ALLREDUCE", MEMCPY_OUT_FUSION_BUFFER]
    expected = [(ph, name) for name in phases for ph in ("B", "E")]
    assert [(e["ph"], e["name"]) for e in by_row["grad/b"]] == expected
    w = [(e["ph"], e["name"]) for e in by_row["grad/w"]]
    assert w == expected[:1] + [("i", "1"), ("i", "0")] + expected[1:]  # ticks in NEGOTIATE
    ticks = [e for e in by_row["grad/w"] if e["ph"] == "i"]
    assert [t["args"]["rank"] for t in ticks] == [1, 0] and all(t["s"] == "t" for t in ticks)
    assert ticks[0]["ts"] == pytest.approx(10000500.0)
    allreduce = next(e for e in by_row["grad/b"] if (e["ph"], e["name"]) == ("B", "ALLREDUCE"))
    assert allreduce["args"] == {"algorithm": "ring", "transport": "shm", "bytes": 4096}
    assert allreduce["ts"] == pytest.approx(10004000.0)
    negotiate = by_row["grad/b"][0]
    assert negotiate["args"] == {"op": "allreduce"} and negotiate["ts"] == pytest.approx(1e7)


def test_timestamps_are_exact_microseconds_and_ties_are_broken(tl, tmp_path):
    path = str(tmp_path / "tl.json")
    tl.start(path)
    tl.begin("x", QUEUE, t=12.345678912)
    tl.begin("x", "ALLREDUCE", t=12.345678912)  # same instant: E then B, 1 ns apart
    tl.end("x", t=1.0)  # earlier than the row's last event: moved after it
    tl.stop()
    text = read_bytes(path).decode()
    assert '"ts":12345678.912' in text
    events = load(path)
    check_rows_well_formed(events)
    assert [e["ts"] for e in rows(events)["x"]] == pytest.approx(
        [12345678.912, 12345678.913, 12345678.914, 12345678.915])


def test_odd_names_and_args_stay_valid_json(tl, tmp_path):
    path = str(tmp_path / "tl.json")
    tl.start(path)
    name = 'grad/"quoted"\\back\nslash/ünïcode/\u2603'
    tl.begin(name, "ALLGATHER", {"nan": float("nan"), "arr": np.float32(1.5)})
    tl.begin(name, "BROADCAST", {"obj": object(), "list": [np.int8(1), 2]})
    tl.end(name, {"error": "PeerLostError: rank 2 was lost"})
    tl.stop()
    raw = read_bytes(path)
    raw.decode("ascii")  # everything is escaped
    events = load(path)
    row = rows(events)[name]
    assert row[0]["args"]["nan"] == "nan" and "1.5" in row[0]["args"]["arr"]  # repr fallback
    assert row[2]["args"]["list"] == [1, 2] and "object" in row[2]["args"]["obj"]
    assert (row[3]["ph"], row[3]["args"]) == ("E", {"error": "PeerLostError: rank 2 was lost"})


def test_mark_cycle_records_only_when_enabled(tmp_path):
    for enabled in (False, True):
        tl = Timeline()
        path = str(tmp_path / f"tl{enabled}.json")
        tl.start(path, pid=1, mark_cycles=enabled)
        assert tl.mark_cycles is enabled
        tl.mark_cycle(t=5.0)
        tl.mark_cycle()
        tl.stop()
        assert not tl.mark_cycles
        cycles = [e for e in load(path) if e["name"] == "CYCLE"]
        if not enabled:
            assert cycles == []
        else:
            assert len(cycles) == 2
            assert cycles[0] == {"name": "CYCLE", "ph": "i", "ts": 5e6, "pid": 1, "tid": 0,
                                 "s": "p"}


def test_end_of_an_unknown_name_is_ignored_and_open_phases_stay_open(tl, tmp_path):
    path = str(tmp_path / "tl.json")
    tl.start(path)
    tl.end("never-begun")
    tl.begin("stuck", "ALLREDUCE")
    tl.stop()
    events = load(path)
    assert [(e["ph"], e["name"]) for e in rows(events)["stuck"]] == [("B", "ALLREDUCE")]
    assert "never-begun" not in json.dumps(events)


def _event_of_size(i, size):
    text = '{"name":"e%d","ph":"i","ts":0,"pid":0,"tid":0,"args":{"pad":""}}' % i
    return text.replace('"pad":""', '"pad":"%s"' % ("x" * (size - len(text))))


def test_every_write_stays_inside_one_page_and_leaves_valid_json(tmp_path, monkeypatch):
    """The crash-safety argument: the only writes to the live file are single pwrites
    inside one page (all or nothing under SIGKILL), and after each one the file parses;
    everything else is a rename of a finished temporary file."""
    path = str(tmp_path / "t.json")
    real, sizes = _trace_file._write_in_page, []

    def checked(fd, data, offset):
        page = _trace_file.PAGE_BYTES
        assert offset // page == (offset + len(data) - 1) // page
        real(fd, data, offset)
        json.loads(read_bytes(path).decode())
        sizes.append(os.path.getsize(path))

    monkeypatch.setattr(_trace_file, "_write_in_page", checked)
    monkeypatch.setattr(_trace_file, "INITIAL_ROOM", 5000)  # many rebuilds
    rng = random.Random(3)
    first = _event_of_size(0, 60)
    f = _trace_file.TraceFile(path, first, room=5000)
    expected = [json.loads(first)]
    for _ in range(120):
        batch = [_event_of_size(len(expected) + k,
                                rng.choice([40, 200, 1500, _trace_events.MAX_EVENT_BYTES]))
                 for k in range(rng.randint(1, 4))]
        f.append(batch)
        expected += [json.loads(e) for e in batch]
    assert json.loads(read_bytes(path).decode()) == expected
    assert len(set(sizes)) > 5  # the file was rebuilt bigger several times
    f.close()
    f.close()
    text = read_bytes(path).decode()
    assert text.endswith("}\n]") and json.loads(text) == expected  # trimmed
    assert os.listdir(tmp_path) == ["t.json"]


def test_oversized_events_are_cut_to_fit_a_page():
    big = _timeline.event_json("B", "x", 0, 1, 5, {"pad": "y" * 10_000})
    assert len(big) <= _trace_events.MAX_EVENT_BYTES
    assert json.loads(big)["args"] == {"args_bytes": len(json.dumps({"pad": "y" * 10_000},
                                                                  separators=(",", ":")))}
    long_name = _timeline.event_json("i", "\u2603" * 5000, 0, 1, 5)
    assert len(long_name) <= _trace_events.MAX_EVENT_BYTES
    assert json.loads(long_name)["name"] == "\u2603" * 256 + "..."


# -- control ---------------------------------------------------------------------------

def test_off_records_nothing(tmp_path):
    tl = Timeline()
    assert tl.active is False and tl.path is None and tl.mark_cycles is False
    tl.begin(["a", "b"], QUEUE, {"x": 1})
    tl.end("a")
    tl.negotiate_tick("a", 0)
    tl.mark_cycle()
    tl.flush()
    tl.stop()
    path = str(tmp_path / "tl.json")
    tl.start(path)
    tl.stop()
    size = os.path.getsize(path)
    tl.begin("late", QUEUE)
    tl.stop()
    assert os.path.getsize(path) == size and len(load(path)) == 1


def test_start_switches_files_and_restarts_cleanly(tl, tmp_path):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "sub" / "dir" / "b.json")
    tl.start(a, pid=0)
    tl.begin("x", QUEUE)
    tl.start(b, pid=5, mark_cycles=True)  # parents made; a is finished and closed
    assert tl.active and tl.path == b
    tl.begin("y", QUEUE)
    tl.end("x")  # x's row lives in a: in b it is unknown
    tl.mark_cycle()
    tl.stop()
    tl.stop()  # idempotent
    ea, eb = load(a), load(b)
    assert set(rows(ea)) == {"x"} and set(rows(eb)) == {"y"}
    assert [e["ph"] for e in rows(ea)["x"]] == ["B"]
    assert {e["pid"] for e in ea} == {0} and {e["pid"] for e in eb} == {5}
    assert eb[0]["args"] == {"name": "rank 5"}  # b has its own metadata
    tl.start(a)  # restart on an old path: replaced
    tl.begin("z", QUEUE)
    tl.stop()
    assert set(rows(load(a))) == {"z"}
    assert sorted(os.listdir(tmp_path)) == ["a.json", "sub"]  # no temporary left


def test_a_start_that_cannot_create_its_file_leaves_the_current_one_running(tl, tmp_path):
    a = str(tmp_path / "a.json")
    (tmp_path / "blocker").write_text("a file, not a directory")
    tl.start(a)
    with pytest.raises(OSError):
        tl.start(str(tmp_path / "blocker" / "b.json"))
    assert tl.active and tl.path == a
    tl.begin("x", QUEUE)
    tl.stop()
    assert set(rows(load(a))) == {"x"}


def test_writer_thread_flushes_without_stop(tl, tmp_path):
    path = str(tmp_path / "tl.json")
    tl.start(path, flush_interval=0.02)
    tl.begin("soon", QUEUE)
    deadline = time.monotonic() + 10
    while "soon" not in rows(load(path)):
        assert time.monotonic() < deadline, "the writer thread never wrote the event"
        time.sleep(0.01)


def test_a_failed_write_keeps_the_file_valid_and_turns_the_timeline_off(
        tl, tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "tl.json")
    tl.start(path, flush_interval=0.01)
    tl.begin("before", QUEUE)
    tl.flush()
    real_pwrite, failed = os.pwrite, []

    def half_then_enospc(fd, data, offset):
        if not failed and len(data) > 10:
            failed.append(True)
            real_pwrite(fd, bytes(data)[:len(data) // 2], offset)  # a torn write...
            raise OSError(errno.ENOSPC, "No space left on device")  # ...then a full disk
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", half_then_enospc)
    tl.begin("during", "ALLREDUCE", {"pad": "x" * 500})
    deadline = time.monotonic() + 10
    while tl.active:  # the writer thread hits the error and turns the timeline off
        assert time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.undo()
    assert failed and "write failed" in caplog.text
    assert set(rows(load(path))) == {"before"}
    tl.begin("after", QUEUE)  # off now: a no-op
    tl.stop()
    assert set(rows(load(path))) == {"before"}


def test_many_threads_recording_at_once(tl, tmp_path):
    path = str(tmp_path / "tl.json")
    tl.start(path, flush_interval=0.005)
    threads, per_thread, n_threads = [], 400, 8
    barrier = threading.Barrier(n_threads + 1)

    def work(k):
        barrier.wait()
        for i in range(per_thread):
            name = f"t{k}/{i % 7}"
            tl.begin(name, NEGOTIATE)
            tl.negotiate_tick(name, k)
            tl.begin([name, "shared"], "ALLREDUCE", {"i": i})
            tl.end(name)
            if i % 50 == 0:
                tl.flush()

    for k in range(n_threads):
        threads.append(threading.Thread(target=work, args=(k,)))
        threads[-1].start()
    barrier.wait()
    for _ in range(20):  # the writer thread and these flushes run concurrently
        tl.flush()
        time.sleep(0.002)
    for t in threads:
        t.join()
    tl.stop()
    events = load(path)
    check_rows_well_formed(events)
    by_row = rows(events)
    assert len(by_row) == n_threads * 7 + 1
    count = lambda ph, rows_: sum(e["ph"] == ph for r in rows_ for e in by_row[r])
    own = [r for r in by_row if r != "shared"]
    assert count("B", own) == 2 * n_threads * per_thread
    assert count("E", own) == 2 * n_threads * per_thread
    assert count("i", own) == n_threads * per_thread
    assert count("B", ["shared"]) == n_threads * per_thread


def test_switching_files_while_threads_record(tl, tmp_path):
    paths = [str(tmp_path / f"tl{i}.json") for i in range(3)]
    tl.start(paths[0], flush_interval=0.005)
    errors, per_thread = [], 3000

    def work(k):
        try:
            for i in range(per_thread):
                tl.begin(f"t{k}", "ALLREDUCE")
                tl.end(f"t{k}")
                if i % 100 == 0:
                    time.sleep(0.001)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    switches = 0
    while any(t.is_alive() for t in threads) or switches < 3:
        switches += 1
        tl.start(paths[switches % 3], flush_interval=0.005)
        time.sleep(0.003)
    for t in threads:
        t.join()
    tl.stop()
    assert not errors
    recorded = 0
    for p in paths:
        events = load(p)
        check_rows_well_formed(events)
        recorded += sum(e["ph"] == "B" for e in events)
    assert 0 < recorded <= 2 * per_thread


def test_a_backlog_beyond_the_cap_is_dropped_and_counted(tl, tmp_path, monkeypatch):
    monkeypatch.setattr(_timeline, "MAX_BACKLOG", 10)
    path = str(tmp_path / "tl.json")
    tl.start(path, flush_interval=1000)
    for i in range(25):
        tl.begin("x", f"P{i}")
    tl.flush()
    tl.begin("x", "AFTER")
    tl.stop()
    events = load(path)
    check_rows_well_formed(events)
    assert [e["name"] for e in rows(events)["x"] if e["ph"] == "B"] == \
        [f"P{i}" for i in range(10)] + ["AFTER"]
    overflow = [e for e in events if e["name"] == "TIMELINE_OVERFLOW"]
    assert len(overflow) == 1 and overflow[0]["args"] == {"dropped_records": 15}


def test_a_forked_child_starts_with_the_timeline_off(tmp_path):
    path = str(tmp_path / "tl.json")
    _timeline.timeline.start(path)
    try:
        pid = os.fork()
        if pid == 0:  # child: must not write into the parent's file
            ok = not _timeline.timeline.active and _timeline.timeline.path is None
            _timeline.timeline.begin("child", QUEUE)
            _timeline.timeline.stop()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _timeline.timeline.active
        _timeline.timeline.begin("parent", QUEUE)
    finally:
        _timeline.timeline.stop()
    assert set(rows(load(path))) == {"parent"}


# -- processes that die ----------------------------------------------------------------

# Loads the timeline (LOAD_TIMELINE: no ddl import cost) and records from two threads as
# fast as it can, with some events larger than a page, and flushing every millisecond.
# With several paths, the main thread also switches files.
WRITER = LOAD_TIMELINE + r"""
import threading, time
paths = sys.argv[2:]
tl = mod.timeline
tl.start(paths[0], pid=7, mark_cycles=True, flush_interval=0.001)

def work(k):
    i = 0
    while True:
        name = "t%d/%d" % (k, i % 20)
        tl.begin(name, "NEGOTIATE")
        tl.negotiate_tick(name, k)
        tl.begin([name, "shared"], "ALLREDUCE",
                 {"algorithm": "ring", "transport": "tcp", "bytes": i, "pad": "x" * (i % 6000)})
        tl.end(name)
        tl.mark_cycle()
        i += 1

for k in range(2):
    threading.Thread(target=work, args=(k,), daemon=True).start()
print("ready", flush=True)
n = 0
while True:
    time.sleep(0.01)
    if len(paths) > 1:
        n += 1
        tl.start(paths[n % len(paths)], pid=7, mark_cycles=True, flush_interval=0.001)
"""


def _head(path, n=1024):
    with open(path, "rb") as f:
        return f.read(n)


@pytest.mark.parametrize("n_files,rounds", [(1, 30), (2, 15)])
def test_file_is_valid_json_whenever_the_writer_is_sigkilled(tmp_path, n_files, rounds):
    rng = random.Random(n_files)
    counts = []
    for r in range(rounds):
        paths = [str(tmp_path / f"r{r}-{i}.json") for i in range(n_files)]
        proc = subprocess.Popen([sys.executable, "-c", WRITER, DDL_DIR, *paths],
                                stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"ready\n"
            deadline = time.monotonic() + 30
            while b"thread_name" not in _head(paths[0]):  # events are being written
                assert time.monotonic() < deadline
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.08))
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        for p in paths:
            if os.path.exists(p):  # a file not yet switched to may not exist
                events = load(p)
                check_rows_well_formed(events)
                counts.append(len(events))
    # the kills landed mid-stream: files with many, and different numbers of, events
    assert len(counts) >= rounds and max(counts) > 1000 and len(set(counts)) >= 3


def test_events_recorded_before_a_normal_exit_are_written(tmp_path):
    path = str(tmp_path / "tl.json")
    script = LOAD_TIMELINE + (
        "mod.timeline.start(sys.argv[2], flush_interval=1000)\n"
        "mod.timeline.begin('last', 'ALLREDUCE')\n")
    subprocess.run([sys.executable, "-c", script, DDL_DIR, path], check=True, timeout=60)
    assert set(rows(load(path))) == {"last"}


# -- cost (not a test: `python tests/test_timeline.py`) ---------------------------------

def _per_call_ns(fn, n):
    """Best of 5 runs of ``n`` calls, minus the loop's own cost, in ns per call."""
    import timeit
    best = min(timeit.repeat(fn, number=n, repeat=5)) / n
    empty = min(timeit.repeat(lambda: None, number=n, repeat=5)) / n
    return (best - empty) * 1e9


def measure(n=100_000):
    """Print the cost of recording, per call, with the timeline off and on."""
    import tempfile
    tl = Timeline()
    names, args = ["grad/w"], {"algorithm": "ring", "transport": "shm", "bytes": 4096}

    def guarded():
        if tl.active:
            tl.begin(names, "ALLREDUCE", args)

    print(f"off, `if timeline.active:` guard   : {_per_call_ns(guarded, n):7.1f} ns")
    print(f"off, unguarded timeline.begin(...) : "
          f"{_per_call_ns(lambda: tl.begin(names, 'ALLREDUCE', args), n):7.1f} ns")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tl.json")
        tl.start(path, flush_interval=1000)  # the writer thread stays asleep
        on = _per_call_ns(lambda: tl.begin(names, "ALLREDUCE", args), n // 10)
        print(f"on, timeline.begin(1 name, args)   : {on:7.1f} ns (caller's thread)")
        fused = [f"grad/{i}" for i in range(64)]
        on = _per_call_ns(lambda: tl.begin(fused, "ALLREDUCE", args), n // 10)
        print(f"on, timeline.begin(64 names, args) : {on:7.1f} ns (caller's thread)")
        tl._sink.records.clear()  # only what is measured next gets written
        for _ in range(n):
            tl.begin(names, "ALLREDUCE", args)
        t0 = time.perf_counter_ns()
        tl.flush()
        write = (time.perf_counter_ns() - t0) / (2 * n)  # each begin: an E and a B
        print(f"on, writer: format + pwrite        : {write:7.1f} ns per event "
              f"({2 * n} events)")
        sink = tl._sink
        one = [(_timeline._BEGIN, time.monotonic(), ("grad/w",), "ALLREDUCE", args)]

        def direct():  # what writing each record at once would cost the caller
            with sink._lock:
                sink._file.append(sink._format(one))

        print(f"(direct write per record instead  : {_per_call_ns(direct, 5000):7.1f} ns)")
        for _ in range(n // 64):
            tl.begin(fused, "ALLREDUCE", args)
        t0 = time.perf_counter_ns()
        tl.flush()
        write = (time.perf_counter_ns() - t0) / (2 * 64 * (n // 64))
        print(f"on, writer, 64-name records        : {write:7.1f} ns per event")
        t0 = time.perf_counter_ns()
        tl.stop()
        print(f"stop() with a {os.path.getsize(path) / 1e6:.0f} MB file (trim)   : "
              f"{(time.perf_counter_ns() - t0) / 1e6:7.1f} ms")


if __name__ == "__main__":
    measure()
