"""The scaling model (tools/scaling, docs/scaling.md): its formulas, its fit, and that
the document's tables are exactly what the code derives from the committed benchmark
data, so the document cannot drift from the code. Pure computation: no processes."""

from __future__ import annotations

import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.scaling import fit, inputs, model, report  # noqa: E402


def test_document_tables_are_derived_from_the_code():
    text = open(report.DOC).read()
    a, b = text.index(report.BEGIN) + len(report.BEGIN), text.index(report.END)
    assert text[a:b].strip() == report.tables().strip(), (
        "docs/scaling.md is stale: run python -m tools.scaling report")
    assert os.path.exists(report.PLOT)


def test_algorithm_costs():
    link = model.Link(alpha=1e-5, beta=1e-9)
    n = 1 << 20
    assert model.ring_allreduce(n, 1, link) == 0.0
    assert model.ring_allreduce(n, 2, link) == pytest.approx(2e-5 + n * 1e-9)
    assert model.ring_allreduce(n, 8, link) == pytest.approx(14e-5 + 14 / 8 * n * 1e-9)
    assert model.recursive_doubling_allreduce(n, 8, link) == pytest.approx(3 * (1e-5 + n * 1e-9))
    assert model.recursive_doubling_allreduce(n, 5, link) == pytest.approx(3 * (1e-5 + n * 1e-9))
    fast, slow = model.Link(1e-6, 1e-10), model.Link(1e-5, 1e-9)
    # one host: only the inside ring; one rank per host: only the outside ring
    assert model.hierarchical_allreduce(n, 1, 4, fast, slow) == model.ring_allreduce(n, 4, fast)
    assert model.hierarchical_allreduce(n, 4, 1, fast, slow) == model.ring_allreduce(n, 4, slow)
    # across hosts, the slice rings share the link: the same bytes leave each host as in
    # a ring of hosts, and fewer latency steps than a flat ring through every GPU
    h = model.hierarchical_allreduce(n, 16, 4, fast, slow)
    assert h < model.flat_ring_allreduce(n, 16, 4, fast, slow)
    assert h > model.ring_allreduce(n, 16, slow) - 1e-12


def test_step_model():
    layers = ((1000, 1e9),) * 10  # ten equal layers
    w = model.Workload("toy", layers, images_per_second=100.0, batch=10)
    assert w.compute_s == pytest.approx(0.1)
    ready = model.ready_times(w, w.compute_s)
    assert [r[0] for r in ready] == sorted(r[0] for r in ready)
    assert ready[-1][0] == pytest.approx(0.1) and ready[0][0] == pytest.approx(0.1 / 3 + 0.1 * 2 / 30)

    def cluster(gpus, beta, jitter=0.0):
        return model.Cluster(max(1, gpus // 4), min(gpus, 4), model.Link(0, beta),
                             model.Link(0, beta), jitter)

    def runtime(fusion, cycle=0.0):
        return model.Runtime("t", lambda n, c: model.ring_allreduce(n, c.gpus, c.inter),
                             lambda c: 0.0, fusion, cycle)

    rt = runtime(1e9)
    assert model.efficiency(w, cluster(1, 1e-9), rt) == 1.0
    # free communication: perfect; slower links: lower, never above 1
    assert model.efficiency(w, cluster(8, 1e-15), rt) == pytest.approx(1.0)
    effs = [model.efficiency(w, cluster(8, b), rt) for b in (1e-9, 1e-6, 1e-4)]
    assert effs[0] >= effs[1] >= effs[2] and effs[2] < 0.5
    # communication that cannot overlap: the last layer's gradients end the step
    tail = model.step(w, cluster(8, 1e-6), rt) - w.compute_s
    assert tail >= model.ring_allreduce(4000, 8, model.Link(0, 1e-6)) - 1e-12
    # a cycle only delays; jitter only slows
    assert model.step(w, cluster(8, 1e-6), runtime(1e9, 5e-3)) >= model.step(w, cluster(8, 1e-6), rt)
    assert model.efficiency(w, cluster(512, 1e-15, 0.02), rt) == pytest.approx(
        1 / (1 + 0.02 * math.sqrt(2 * math.log(512))))


def test_fit_recovers_a_known_link():
    truth = model.Link(alpha=50e-6, beta=1 / 2e9)
    cost = fit.tcp_cost(64 * 1024)
    rows = []
    for size in (4, 64, 1024, 65536, 1 << 20, 1 << 22, 1 << 24):
        steps, nbytes = cost(size, 2)
        rows.append({"size": str(size), "ranks": "2",
                     "time_us": str((steps * truth.alpha + nbytes * truth.beta) * 1e6)})
    got = fit.fit(rows, cost)
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-3)
    assert got.beta == pytest.approx(truth.beta, rel=1e-3)
    assert all(m == pytest.approx(p, rel=1e-2) for _, m, p in fit.residuals(rows, cost, got))
    with pytest.raises(ValueError):
        fit.fit(rows[:3], cost)


def test_inputs_are_the_models_they_name():
    w = report.workloads()
    # keras.applications' trainable parameters
    assert w["inception_v3"].parameters == 23_817_352
    assert w["resnet101"].parameters == 44_601_832
    assert w["vgg16"].parameters == 138_357_544
    # ResNet-101's throughput lies between ResNet-50's and ResNet-152's
    assert inputs.P100_IMAGES_PER_SECOND["resnet152"] < w["resnet101"].images_per_second \
        < inputs.P100_IMAGES_PER_SECOND["resnet50"]


def test_predict_for_a_custom_model():
    def effs(text):
        return [float(line.rsplit(":", 1)[1].strip(" %\n")) for line in text.splitlines()[1:]]
    slow = effs(report.predict(100e6, 200, hosts=16, gpus_per_host=4, link_gbit=10))
    fast = effs(report.predict(100e6, 200, hosts=16, gpus_per_host=4, link_gbit=100))
    alone = effs(report.predict(100e6, 200, hosts=1, gpus_per_host=1, link_gbit=10))
    assert len(slow) == len(fast) == 3
    assert all(0 < s <= f <= 100 for s, f in zip(slow, fast)) and slow != fast
    assert alone == [100.0, 100.0, 100.0]
