"""The engine's bookkeeping of a group's parts, driven in-process: its requests are
captured as the control stream would send them, and the leader's answers are fed back
as the control stream would deliver them (the leader's side: test_server_leader.py)."""

from __future__ import annotations

import threading
import time

import pytest

from ddl.core.errors import MismatchError
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
