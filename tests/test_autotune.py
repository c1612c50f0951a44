"""Autotuning (ddlrun --autotune): the leader's tuner with a synthetic score, the leader
stamping its settings, and a real 2-rank job whose ranks switch settings together."""

from __future__ import annotations

import csv
import json
import math
import os
import sys

import numpy as np
import pytest

from ddl.core import config as _config
from ddl.core.errors import ConfigError
from ddl.server.autotune import (FUSION, LOG_COLUMNS, SHM_ALGORITHM, SMALL_MESSAGE, Tuner,
                                 knobs_for)
from ddl.server.leader import Leader
from ddl.v1 import coordinator_pb2 as pb

from _grpc_client import req
from test_launcher_support import ddlrun, job_env, script

optuna = pytest.importorskip("optuna")  # the `autotune` extra (in the dev extra too)

DEFAULTS = {k: _config.default(k) for k in _config.TUNABLE}
MiB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _response(nbytes: int, setting: pb.TuningSetting) -> pb.Response:
    r = pb.Response(op=pb.ALLREDUCE, dtype=pb.FLOAT32,
                    tensors=[pb.TensorEntry(name="w", shape=[nbytes // 4])])
    r.tuning.CopyFrom(setting)
    return r


def _step_seconds(setting: pb.TuningSetting) -> float:
    """A synthetic cost with one clear optimum: fusion threshold 2**18 and the
    one-round shared-memory algorithm (the defaults, 2**26 and auto, are far off)."""
    off = abs(math.log2(setting.fusion_threshold_bytes) - 18)
    return 0.01 * (1 + 0.2 * off + (0 if setting.shm_allreduce_algorithm == "one_round"
                                    else 0.5))


def _drive(tuner: Tuner, clock: Clock, steps: int) -> list:
    """Run ``steps`` one-response flushes, each taking the current setting's time; the
    setting each was stamped with."""
    used = []
    for _ in range(steps):
        setting = pb.TuningSetting()
        setting.CopyFrom(tuner.setting())
        used.append(setting)
        tuner.observe([_response(4 * MiB, setting)])
        clock.t += _step_seconds(setting)
    return used


def test_tuner_finds_a_better_setting_than_the_default_and_logs_every_sample(tmp_path):
    clock, log_file = Clock(), tmp_path / "autotune.csv"
    tuner = Tuner(DEFAULTS, (FUSION, SHM_ALGORITHM), warmup_samples=2, steps_per_sample=3,
                  max_samples=25, log_file=str(log_file), seed=7, clock=clock)
    used = _drive(tuner, clock, 4 * 27 + 10)
    assert tuner.done
    best = tuner.best
    default_setting = tuner.setting().__class__(
        fusion_threshold_bytes=DEFAULTS["fusion_threshold"],
        shm_allreduce_algorithm=DEFAULTS["shm_allreduce_algorithm"])
    tuned_setting = tuner.setting()
    assert tuned_setting.fusion_threshold_bytes == best["fusion_threshold"]
    assert _step_seconds(tuned_setting) < _step_seconds(default_setting), best
    # the untuned knobs keep their configured values
    assert best["tcp_chunk_bytes"] == DEFAULTS["tcp_chunk_bytes"]
    assert best["small_message_bytes"] == DEFAULTS["small_message_bytes"]
    # after tuning the setting no longer changes
    assert {s.id for s in used[-5:]} == {tuned_setting.id}

    with open(log_file) as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == LOG_COLUMNS
    rows = [dict(zip(LOG_COLUMNS, r)) for r in rows[1:]]
    assert len(rows) == 2 + 25
    assert [int(r["sample"]) for r in rows] == list(range(1, 28))
    assert [r["phase"] for r in rows] == ["warmup"] * 2 + ["trial"] * 25
    ids = [int(r["setting_id"]) for r in rows]
    assert ids == sorted(set(ids))  # a new setting per sample
    assert all(int(r["steps"]) >= 3 and float(r["score_bytes_per_s"]) > 0 for r in rows)
    # warm-up samples and the first trial run the configured setting
    for r in rows[:3]:
        assert int(r["fusion_threshold"]) == DEFAULTS["fusion_threshold"]
        assert r["shm_allreduce_algorithm"] == DEFAULTS["shm_allreduce_algorithm"]
    # each row's score is its setting's synthetic throughput
    for r in rows:
        s = pb.TuningSetting(fusion_threshold_bytes=int(r["fusion_threshold"]),
                             shm_allreduce_algorithm=r["shm_allreduce_algorithm"])
        assert float(r["score_bytes_per_s"]) == pytest.approx(4 * MiB / _step_seconds(s),
                                                              rel=1e-3)


def test_knobs_follow_the_job_shape():
    assert knobs_for(False, "auto") == (FUSION, SHM_ALGORITHM)
    assert SMALL_MESSAGE in knobs_for(False, "tcp")
    assert SHM_ALGORITHM not in knobs_for(False, "tcp")
    assert {k.key for k in knobs_for(True, "auto")} == set(_config.TUNABLE)


def test_leader_stamps_the_setting_fuses_by_it_and_assigns_no_cache_slot_while_tuning():
    clock = Clock()
    tuner = Tuner(dict(DEFAULTS, fusion_threshold=64), (FUSION,), warmup_samples=1,
                  steps_per_sample=1, max_samples=1, clock=clock)
    leader = Leader(2, fusion_threshold=1 << 30, clock=clock, cache_capacity=8, tuner=tuner)

    def step():
        """One step of a loop: the same two names (the tuner counts a step when a name
        comes round again), two 16-float tensors (64 bytes each) ready together."""
        out = []
        for rank in (0, 1):
            for d in leader.submit(rank, [req("a", shape=(16,)), req("b", shape=(16,))]):
                if d[1].WhichOneof("kind") == "responses":
                    out.append((d[0], list(d[1].responses.responses)))
        clock.t += 1
        return out

    first = step()
    for rank, resps in first:
        # the tuner's 64-byte threshold, not the leader's 1 GiB: no fusion
        assert [len(r.tensors) for r in resps] == [1, 1]
        assert all(r.tuning.id == 1 and r.tuning.fusion_threshold_bytes == 64 for r in resps)
        assert all(t.cache_slot == 0 for r in resps for t in r.tensors)
    step()  # a name comes round: the warm-up sample's first step begins
    step()  # which ends it
    step()  # the one trial's step begins
    assert not tuner.done
    step()  # and ends: the tuner keeps the best (here: the only) setting
    assert tuner.done
    last = step()
    for rank, resps in last:
        assert all(r.tuning.id == tuner.setting().id for r in resps)
        # tuning is over: calls get cache slots again
        assert all(t.cache_slot > 0 for r in resps for t in r.tensors)


def test_without_optuna_the_error_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna fails
    with pytest.raises(ConfigError, match=r"needs optuna.*ddl-train\[autotune\]"):
        Tuner(DEFAULTS)
    from ddl.launcher import cli
    with pytest.raises(SystemExit) as exc:
        cli.main(["-np", "2", "--autotune", sys.executable, "-c", "pass"])
    assert exc.value.code == 2
    assert "--autotune (DDL_AUTOTUNE=1) needs optuna" in capsys.readouterr().err


def test_import_ddl_does_not_import_optuna():
    import subprocess
    code = ("import sys, ddl, ddl.server.leader, ddl.server.daemon; "
            "assert 'optuna' not in sys.modules, 'optuna imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


JOB = r'''
import json, os, sys
import numpy as np
import ddl
from ddl.runtime.runtime import runtime

ddl.init()
rank, size = ddl.rank(), ddl.size()
ids, wrong = [], []
for step in range(int(os.environ["STEPS"])):
    # three sizes: across the fusion thresholds tried and the algorithms' crossovers
    xs = [np.full(n, rank + step, np.float32) for n in (7, 3000, 150000)]
    outs = ddl.grouped_allreduce(xs, name="grads", op=ddl.Sum)
    expected = sum(r + step for r in range(size))
    if not all(np.array_equal(o, np.full_like(x, expected)) for o, x in zip(outs, xs)):
        wrong.append(step)
    ids.append(runtime().config.tuning_id)
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    cache = runtime().engine.cache  # slots given once tuning ended
    json.dump({"ids": ids, "wrong": wrong, "cached": len(cache._slots) if cache else -1,
               "final": {k: getattr(runtime().config, k) for k in
                         ("fusion_threshold", "small_message_bytes", "tcp_chunk_bytes",
                          "shm_allreduce_algorithm", "hierarchical_allreduce")}}, f)
ddl.shutdown()
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport, nodes", [("auto", ""), ("tcp", ""), ("auto", "2,2")])
def test_a_job_switches_settings_together_and_stays_correct(tmp_path, transport, nodes):
    """2 ranks over shared memory, or TCP; or 4 ranks on two (simulated) nodes, where
    every knob is tuned and the settings pass through the other node's coordinator."""
    warmup, samples, steps_per_sample = 1, 5, 3
    log_file = tmp_path / "tune.csv"
    env = job_env(tmp_path, OUT=str(tmp_path), STEPS="80")
    if nodes:
        env["DDL_TEST_LOCAL_NODES"] = nodes
    size = 4 if nodes else 2
    path = script(tmp_path, "job.py", JOB)
    r = ddlrun(["-np", str(size), "--transport", transport, "--autotune",
                "--autotune-log-file", str(log_file),
                "--autotune-warmup-samples", str(warmup),
                "--autotune-steps-per-sample", str(steps_per_sample),
                "--autotune-bayes-opt-max-samples", str(samples),
                sys.executable, path], env, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = []
    for rank in range(size):
        with open(tmp_path / f"rank{rank}.json") as f:
            ranks.append(json.load(f))
    assert all(rank["wrong"] == [] for rank in ranks)
    # every step ran with the same setting on every rank
    assert all(rank["ids"] == ranks[0]["ids"] for rank in ranks)
    assert all(rank["final"] == ranks[0]["final"] for rank in ranks)
    ids = ranks[0]["ids"]
    assert ids == sorted(ids) and ids[0] >= 1
    # once tuning ended, the three names were cached (and ran cached, correctly)
    assert all(rank["cached"] == 3 for rank in ranks)

    with open(log_file) as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == LOG_COLUMNS
    rows = [dict(zip(LOG_COLUMNS, row)) for row in rows[1:]]
    assert len(rows) == warmup + samples
    assert [row["phase"] for row in rows] == ["warmup"] * warmup + ["trial"] * samples
    assert all(int(row["steps"]) >= steps_per_sample and float(row["score_bytes_per_s"]) > 0
               for row in rows)
    logged = [int(row["setting_id"]) for row in rows]
    # the ranks ran each sample's setting, and then the kept one to the end
    assert set(logged) <= set(ids)
    assert ids[-1] == logged[-1] + 1 and ids.count(ids[-1]) > 10
    # the kept setting is one that was tried (its values are in the log)
    final = ranks[0]["final"]
    tried = {(int(row["fusion_threshold"]), row["shm_allreduce_algorithm"],
              int(row["small_message_bytes"]), int(row["tcp_chunk_bytes"])) for row in rows}
    assert (final["fusion_threshold"], final["shm_allreduce_algorithm"],
            final["small_message_bytes"], final["tcp_chunk_bytes"]) in tried
    if transport == "tcp" or nodes:  # the TCP knobs were tuned too
        assert len({(row["small_message_bytes"], row["tcp_chunk_bytes"])
                    for row in rows}) > 1
    if nodes:  # and hierarchical allreduce
        assert final["hierarchical_allreduce"] in {row["hierarchical_allreduce"] for row in rows}


def test_horovod_autotune_variables_are_read_as_their_twins():
    cfg = _config.load({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/t.csv",
                        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
                        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
                        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6"})
    assert (cfg.autotune, cfg.autotune_log_file, cfg.autotune_warmup_samples,
            cfg.autotune_steps_per_sample, cfg.autotune_max_samples) == (
        True, "/tmp/t.csv", 1, 4, 6)
    with pytest.raises(ConfigError, match="DDL_AUTOTUNE_STEPS_PER_SAMPLE"):
        _config.load({"DDL_AUTOTUNE_STEPS_PER_SAMPLE": "0"})


def test_a_failing_tuner_ends_tuning_with_the_configured_setting(tmp_path):
    clock = Clock()
    tuner = Tuner(DEFAULTS, (FUSION,), warmup_samples=0, steps_per_sample=1, max_samples=3,
                  log_file=str(tmp_path / "t.csv"), clock=clock)
    tuner._log.close()  # writing the first sample's row fails
    _drive(tuner, clock, 5)
    assert tuner.done and tuner.best == DEFAULTS
    assert tuner.setting().fusion_threshold_bytes == DEFAULTS["fusion_threshold"]
