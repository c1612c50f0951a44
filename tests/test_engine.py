"""The engine's bookkeeping of a group's parts, driven in-process: its requests are
captured as the control stream would send them, and the leader's answers are fed back
as the control stream would deliver them (the leader's side: test_server_leader.py)."""

from __future__ import annotations

import threading
import time

import pytest

from ddl.core.errors import DuplicateNameError, MismatchError
from ddl.runtime.engine import Engine, Entry
from ddl.runtime.handle import GroupHandle, Handle
from ddl.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)


def _group(engine: Engine, name: str, n: int):
    entries = [Entry(pb.Request(name=f"{name}/{i}", op=pb.ALLREDUCE, group_size=n), None,
                     Handle("allreduce", f"{name}/{i}", 5.0)) for i in range(n)]
    handle = GroupHandle("allreduce", name, 5.0, [e.handle for e in entries], list,
                         lambda error, rest: engine.abandon(
                             [e for e in entries if e.handle in rest]))
    engine.submit(entries, group=name)
    return handle


def _answer(name: str, error: pb.Error = None) -> pb.CoordinatorMessage:
    response = pb.Response(op=pb.ALLREDUCE, tensors=[pb.TensorEntry(name=name)])
    if error is not None:
        response.error.CopyFrom(error)
    return pb.CoordinatorMessage(responses=pb.ResponseList(responses=[response]))


def _error(name: str) -> pb.CoordinatorMessage:
    err = pb.Error(kind=pb.MISMATCH, message=f"allreduce '{name}': group size mismatch",
                   op="allreduce", name=name)
    return pb.CoordinatorMessage(responses=pb.ResponseList(responses=[pb.Response(
        op=pb.ALLREDUCE, tensors=[pb.TensorEntry(name=name)], error=err)]))


def test_a_group_retried_after_it_failed_waits_for_its_failed_parts_answers():
    sent = []
    engine = Engine(0, execute=lambda response, entries: None, send=sent.extend)
    try:
        first = _group(engine, "g", 2)
        assert [r.name for r in sent] == ["g/0", "g/1"]
        assert sent[0].call_id == sent[1].call_id > 0   # one call, numbered
        engine.on_message(_error("g/0"))
        with pytest.raises(MismatchError):
            first.wait(5)
        # 'g/1' is still in flight (the leader answers it next): the same call made again
        # waits for that answer, then goes out as a new call, not a DuplicateNameError
        retried = []
        thread = threading.Thread(target=lambda: retried.append(_group(engine, "g", 2)))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive() and len(sent) == 2
        engine.on_message(_error("g/1"))
        thread.join(5)
        assert retried and [r.name for r in sent[2:]] == ["g/0", "g/1"]
        assert sent[2].call_id == sent[3].call_id > sent[0].call_id
    finally:
        engine.stop()


def test_a_name_whose_answer_waits_behind_others_is_free_once_it_is_taken():
    """Horovod runs every response in one background thread, so once a later call has
    returned, an earlier one has finished: a name reused then is free. ddl's blocking
    calls may finish in their own thread, so a reuse waits (bounded) for an earlier
    call of the name whose answer has come but waits behind others."""
    busy = threading.Event()

    def execute(response, entries):
        if response.tensors[0].name == "slow":
            busy.wait(5)   # the executor is busy with an earlier response
        for entry in entries.values():
            entry.handle._set_result(None)

    sent = []
    engine = Engine(0, execute=execute, send=sent.extend)
    try:
        def one(name):
            entry = Entry(pb.Request(name=name, op=pb.ALLREDUCE), None,
                          Handle("allreduce", name, 5.0))
            engine.submit([entry])
            return entry.handle

        one("slow"), one("n")            # n: an async call whose handle nobody waits on
        engine.on_message(_answer("slow"))
        engine.on_message(_answer("n"))  # n's answer waits behind slow's
        time.sleep(0.1)
        with pytest.raises(DuplicateNameError):   # a name with no answer yet: at once
            one("slow2"), one("slow2")
        done = []
        thread = threading.Thread(target=lambda: done.append(one("n")))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive() and not done   # waits for the executor to take n
        busy.set()
        thread.join(5)
        assert done and [r.name for r in sent].count("n") == 2
    finally:
        busy.set()
        engine.stop()
