"""ddl.spark.run against a real local Spark (pyspark, a JVM, barrier execution mode):
one world for the results and the ranks' output, another where a rank fails, and a stage
too big for the slots failing within start_timeout. Skips, saying why, where pyspark or
Java is missing."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import time

import pytest

WHY = ("pyspark is not installed (pip install -e '.[dev]')"
       if importlib.util.find_spec("pyspark") is None else
       "no Java runtime (apt-get install default-jre-headless)"
       if shutil.which("java") is None and not os.environ.get("JAVA_HOME") else None)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no local Spark: {WHY}")


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession
    session = (SparkSession.builder.master("local[3]").appName("ddl-test")
               .config("spark.ui.enabled", "false")
               .config("spark.python.worker.reuse", "false").getOrCreate())
    # start Spark's Python daemon now: it serves every later test, and the leak check
    # counts only what a test itself starts
    session.sparkContext.parallelize(range(3), 3).count()
    # and the one that pandas UDFs (the estimators' transform) get: another environment,
    # so another daemon
    import pandas as pd
    from pyspark.sql import functions as F

    def same(s):
        return s
    same.__annotations__ = {"s": pd.Series, "return": pd.Series}
    session.range(3).select(F.pandas_udf(same, "long")(F.col("id"))).collect()
    yield session
    session.stop()


def _train(scale):
    """A rank's work: collectives, then what it saw (runs inside the Spark tasks)."""
    import sys
    import numpy as np
    import ddl
    r, n = ddl.rank(), ddl.size()
    print(f"rank {r} says hello")
    print(f"rank {r} warns", file=sys.stderr, flush=True)
    total = ddl.allreduce(np.full(1000, float(r) * scale), op=ddl.Sum, name="g")
    rows = ddl.allgather(np.full((r + 1, 2), r), name="rows")
    w = ddl.broadcast(np.array([r + 10.0]), root_rank=2, name="w")
    for step in range(10):  # the response cache
        ddl.allreduce(np.array([float(step)]), name="loss")
    secret_seen = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"DDL_JOB_SECRET" in f.read():
                    secret_seen.append(p)
        except OSError:  # gone meanwhile
            pass
    return {"rank": r, "size": n, "sum": float(total[0]), "rows": rows[:, 0].tolist(),
            "w": float(w[0]), "secret_on_cmdline": secret_seen}


def test_run_returns_every_rank_result_in_order(spark):
    import ddl.spark
    marker = {"DDL_TEST_MARKER": os.environ["DDL_TEST_MARKER"]}  # for the leak check
    stdout, stderr = io.StringIO(), io.StringIO()
    # horovod.spark.run's keywords, as a Horovod script passes them
    out = ddl.spark.run(_train, args=(2.0,), num_proc=3, spark_context=spark.sparkContext,
                        env=marker, start_timeout=120, use_gloo=True, verbose=2,
                        stdout=stdout, stderr=stderr, prefix_output_with_timestamp=True)
    # each rank's output, in the streams given, each line with the time and its rank
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    for stream, name, text in ((stdout, "stdout", "says hello"), (stderr, "stderr", "warns")):
        lines = stream.getvalue().splitlines()
        for r in range(3):
            assert sum(bool(re.fullmatch(rf"{stamp}\[{r}\]<{name}>:rank {r} {text}", line))
                       for line in lines) == 1, (r, lines)
    assert "says hello" not in stderr.getvalue()
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["size"] == 3
        assert o["sum"] == 2.0 * (0 + 1 + 2)
        assert o["rows"] == [0, 1, 1, 2, 2, 2]
        assert o["w"] == 12.0
        assert o["secret_on_cmdline"] == []


def _fails_on_rank_1():
    import numpy as np
    import ddl
    ddl.allreduce(np.ones(4), name="before")
    if ddl.rank() == 1:
        raise ValueError("rank 1 ran out of data")
    ddl.allreduce(np.ones(4), name="after")  # the others wait here, then fail
    return "unreachable"


def test_a_failing_rank_fails_the_run_naming_it(spark):
    import ddl.spark
    t0 = time.monotonic()
    with pytest.raises(ddl.RunError) as info:
        ddl.spark.run(_fails_on_rank_1, num_proc=3, spark_context=spark.sparkContext,
                      env={"DDL_LIVENESS_TIMEOUT_SECONDS": "5",
                           "DDL_TEST_MARKER": os.environ["DDL_TEST_MARKER"]})
    err = info.value
    assert err.rank == 1, str(err)
    assert "rank 1 raised: ValueError: rank 1 ran out of data" in str(err)
    assert "ranks [0, 2] failed after it" in str(err)
    assert "ValueError" in err.traceback
    assert time.monotonic() - t0 < 60  # the others did not wait out a timeout
    # more ranks than Spark's 3 slots: a barrier stage never starts; the job is cancelled
    # and a named timeout comes after start_timeout, not after Spark's ~10 minutes of retries
    t0 = time.monotonic()
    with pytest.raises(ddl.DDLTimeoutError) as info:
        ddl.spark.run(_train, num_proc=4, start_timeout=3, spark_context=spark.sparkContext)
    assert time.monotonic() - t0 < 20
    assert "ddl.spark.run: the 4 tasks of the barrier stage did not start within " \
           "start_timeout 3 s: a barrier stage starts all num_proc=4 tasks at once, and " \
           "Spark can run only 3 tasks at once (master local[3]); run with num_proc <= 3" \
           in str(info.value), str(info.value)
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []
    with pytest.raises(ValueError, match="start_timeout must be a number of seconds > 0"):
        ddl.spark.run(_train, num_proc=2, start_timeout=0, spark_context=spark.sparkContext)
    with pytest.raises(ValueError, match="num_proc must be an int >= 1"):
        ddl.spark.run(_train, num_proc=0, spark_context=spark.sparkContext)
    with pytest.raises(ValueError, match="use_mpi=True asks for mpirun"):
        ddl.spark.run(_train, num_proc=2, use_mpi=True, spark_context=spark.sparkContext)


def test_the_spark_example_runs():
    """examples/spark_allreduce.py starts its own local Spark and runs 2 ranks."""
    import subprocess
    import sys
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples", "spark_allreduce.py")
    r = subprocess.run([sys.executable, example, "--num-proc", "2"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK") and "rank 1: mean [1.0, 1.0, 1.0, 1.0]" in r.stdout


def _regression(spark, rows=480, seed=0):
    """A DataFrame of ML vectors (3 features), a label y = 2 x0 - x1 + 0.5 x2 + 1, a
    weight column, and the true coefficients."""
    import numpy as np
    from pyspark.ml.linalg import Vectors
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 3))
    y = x @ np.array([2.0, -1.0, 0.5]) + 1.0
    data = [(Vectors.dense(a.tolist()), float(b), 1.0 + (i % 2)) for i, (a, b)
            in enumerate(zip(x, y))]
    return spark.createDataFrame(data, ["features", "y", "w"])


def test_torch_estimator_fits_resumes_and_transforms(spark, tmp_path):
    """Horovod's TorchEstimator: fit on 2 Spark tasks with a validation split and a
    metric, a checkpoint per epoch in the store, a fit of the same run_id resuming after
    its last epoch, transform adding the predictions; bad arguments named on the driver
    before any task starts."""
    import numpy as np
    import torch
    from ddl.spark._data import read_shard
    from ddl.spark.common.store import LocalStore, Store
    from ddl.spark.torch import TorchEstimator, TorchModel
    df = _regression(spark)
    store = Store.create(f"file://{tmp_path}")
    assert isinstance(store, LocalStore)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)

    def mae(output, label):
        return (output - label).abs().mean()

    est = TorchEstimator(num_proc=2, store=store, model=model, loss=torch.nn.MSELoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         metrics=[mae], feature_cols=["features"], label_cols=["y"],
                         validation=0.2, batch_size=16, epochs=3, run_id="run1",
                         random_seed=1, train_reader_num_workers=4)  # a reader knob: no effect
    assert est.getBatchSize() == 16 and est.setEpochs(4) is est and est.getEpochs() == 4
    fitted = est.fit(df)
    assert isinstance(fitted, TorchModel) and fitted.getRunId() == "run1"
    history = fitted.getHistory()
    assert sorted(history) == ["loss", "mae", "val_loss", "val_mae"], history
    assert all(len(v) == 4 for v in history.values())
    assert history["loss"][-1] < history["loss"][0] / 10, history
    w = fitted.getModel().weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, [2.0, -1.0, 0.5], atol=0.1)
    assert model.weight.detach().numpy().ravel().tolist() != w.tolist()  # the user's: as given
    ckpt = store.get_checkpoint_path("run1")
    saved = torch.load(ckpt, weights_only=True)
    assert saved["epoch"] == 3 and saved["history"] == history
    # the same run_id with more epochs goes on after the checkpoint's last epoch
    more = est.setEpochs(6).fit(df).getHistory()
    assert more["loss"][:4] == history["loss"] and len(more["loss"]) == 6, more
    # the model predicts on the executors, into "y__output"
    out = fitted.transform(df.limit(8)).toPandas()
    assert list(out.columns) == ["features", "y", "w", "y__output"]
    np.testing.assert_allclose(out["y__output"], out["y"], atol=0.3)
    # the training data went to the store as Parquet, with the weight column too
    assert store.parquet_files(store.get_train_data_path())
    # bad input, named on the driver
    for make, error, message in [
            (lambda: TorchEstimator(num_proc=2, store=store, model=model, loss=mae,
                                    optimizer=est.getOptimizer(), feature_cols=["nope"],
                                    label_cols=["y"]).fit(df), ValueError,
             "TorchEstimator.fit: feature_cols names column(s) ['nope'] that the DataFrame "
             "does not have; it has ['features', 'w', 'y']"),
            (lambda: TorchEstimator(model=model, loss=mae, optimizer=est.getOptimizer(),
                                    feature_cols=["features"], label_cols=["y"]).fit(df),
             ValueError, "store is required"),
            (lambda: TorchEstimator(store=store, model=model, loss=[mae, mae],
                                    optimizer=est.getOptimizer(), feature_cols=["features"],
                                    label_cols=["y"]).fit(df), ValueError,
             "loss must be a callable or a list of 1"),
            (lambda: TorchEstimator(store=store, model=model, loss=mae, batch_size=0,
                                    optimizer=est.getOptimizer(), feature_cols=["features"],
                                    label_cols=["y"]).fit(df), ValueError,
             "batch_size must be an int >= 1, got 0"),
            (lambda: TorchEstimator(transformation_fn=print), ValueError,
             "transformation_fn is not supported here; transform the DataFrame before fit"),
            (lambda: TorchEstimator(batchsize=3), TypeError, "unexpected argument(s) batchsize"),
            (lambda: Store.create("hdfs://nn:8020/ddl"), ValueError,
             "hdfs:// is not one; mount it where every node sees it"),
            # a rank on a host that does not see the store's path (not a shared mount)
            (lambda: read_shard(store, str(tmp_path / "elsewhere"), [], 1, 2),
             FileNotFoundError, "the store must be a path that the driver and every "
                                "executor see")]:
        with pytest.raises(error) as info:
            make()
        assert message in str(info.value), (message, str(info.value))
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []


def test_keras_estimator_fits_with_sample_weights_and_transforms(spark, tmp_path):
    """Horovod's KerasEstimator: fit on 2 Spark tasks (BroadcastGlobalVariables and
    MetricAverage in every rank's model.fit) with sample weights and a validation split,
    a checkpoint per epoch, and transform."""
    import keras
    import numpy as np
    from ddl.spark.common.store import Store
    from ddl.spark.keras import KerasEstimator
    df = _regression(spark, seed=1)
    store = Store.create(str(tmp_path))
    keras.utils.set_random_seed(0)
    # an input of shape (1, 3): the 3-vectors are reshaped to it, as Horovod's estimator
    # reshapes a flat vector column into an image input
    model = keras.Sequential([keras.Input((1, 3)), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, store=store, model=model, loss="mse", metrics=["mae"],
                         optimizer=keras.optimizers.SGD(0.05), feature_cols=["features"],
                         label_cols=["y"], sample_weight_col="w", validation=0.25,
                         batch_size=16, epochs=4, run_id="k1", verbose=0, random_seed=1,
                         inmemory_cache_all=True, callbacks=[keras.callbacks.TerminateOnNaN()])
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert {"loss", "mae", "val_loss", "val_mae"} <= set(history), history
    assert len(history["loss"]) == 4 and history["loss"][-1] < history["loss"][0] / 10
    kernel, bias = fitted.getModel().get_weights()
    np.testing.assert_allclose(kernel.ravel(), [2.0, -1.0, 0.5], atol=0.15)
    np.testing.assert_allclose(bias, [1.0], atol=0.15)
    assert store.exists(store.get_checkpoint_path("k1"))
    out = fitted.setOutputCols(["pred"]).transform(df.limit(6)).toPandas()
    assert list(out.columns) == ["features", "y", "w", "pred"]
    np.testing.assert_allclose(out["pred"], out["y"], atol=0.4)


def test_horovod_spark_mnist_pattern(spark, tmp_path):
    """Horovod's pytorch_spark_mnist.py, its calls as written there: a SparkBackend
    (num_proc, the ranks' output to given streams), libsvm-style sparse vectors reshaped by
    input_shapes into a conv net, a loss that casts the label, setOutputCols, and Spark
    ML's evaluator on the transformed DataFrame (tiny synthetic digits, 1 epoch)."""
    import numpy as np
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.optim as optim
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import functions as SF
    from pyspark.sql import types as T
    import ddl.spark.torch as hvd
    from ddl.spark.common.backend import SparkBackend
    from ddl.spark.common.store import Store
    rng = np.random.default_rng(0)
    rows = []
    for i in range(96):
        label = i % 10
        pixels = rng.choice(784, 40, replace=False)
        rows.append((float(label), Vectors.sparse(784, sorted(pixels.tolist()),
                                                  [1.0 + label] * 40)))
    df = spark.createDataFrame(rows, ["label", "features"])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
            self.fc = nn.Linear(4 * 12 * 12, 10)

        def forward(self, features):
            x = F.relu(F.max_pool2d(self.conv1(features.float()), 2))
            return F.log_softmax(self.fc(x.view(-1, 4 * 12 * 12)), dim=1)

    model = Net()
    loss = nn.NLLLoss()
    out, err = io.StringIO(), io.StringIO()
    backend = SparkBackend(num_proc=2, stdout=out, stderr=err,
                           prefix_output_with_timestamp=True)
    est = hvd.TorchEstimator(backend=backend, store=Store.create(str(tmp_path)), model=model,
                             optimizer=optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
                             loss=lambda input, target: loss(input, target.long()),
                             input_shapes=[[-1, 1, 28, 28]], feature_cols=["features"],
                             label_cols=["label"], batch_size=8, epochs=1, validation=0.1,
                             verbose=1)
    torch_model = est.fit(df).setOutputCols(["label_prob"])
    assert re.search(r"\[0\]<stdout>:epoch 1/1: loss [\d.]+", out.getvalue()), out.getvalue()
    pred = torch_model.transform(df)
    argmax = SF.udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred = pred.withColumn("label_pred", argmax(pred.label_prob))
    assert len(pred.first()["label_prob"]) == 10
    accuracy = MulticlassClassificationEvaluator(predictionCol="label_pred", labelCol="label",
                                                 metricName="accuracy").evaluate(pred)
    assert 0.0 <= accuracy <= 1.0
    with pytest.raises(ValueError, match="give num_proc or backend"):
        hvd.TorchEstimator(backend=backend, num_proc=2, store=est.getStore(), model=model,
                           optimizer=est.getOptimizer(), loss=loss, feature_cols=["features"],
                           label_cols=["label"]).fit(df)


@pytest.mark.timeout(600)  # three Lightning fits on Spark: 40-95 s alone, 300+ s crowded
def test_lightning_estimator_fits_resumes_and_transforms(spark, tmp_path):
    """Horovod's Lightning TorchEstimator: a LightningModule fitted on 2 Spark tasks (its
    batches dicts of columns, a validation split, a user callback on every rank, rank 0's
    line per epoch), a Lightning checkpoint per epoch resumed by a fit of the same run_id,
    the best checkpoint of a user's ModelCheckpoint as the result, transform; then a plain
    module with an optimizer, a loss and a metric (Horovod's legacy use); bad arguments
    named on the driver."""
    pytest.importorskip("pytorch_lightning", reason="lightning is not installed (pip "
                                                    "install -e '.[dev]')")
    # Lightning under its older name, as Horovod's example imports it: the estimator
    # trains with the model's own package
    import pytorch_lightning as pl
    import numpy as np
    import torch
    from ddl.spark.common.backend import SparkBackend
    from ddl.spark.common.store import Store
    from ddl.spark.lightning import TorchEstimator, TorchModel
    df = _regression(spark, seed=2)
    store = Store.create(str(tmp_path))

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.linear(x.reshape(len(x), 3))

        def training_step(self, batch, batch_idx):
            assert sorted(batch) == ["features", "y"] and batch["features"].shape[1:] == (1, 3)
            loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1),
                                                batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1),
                                                batch["y"])
            self.log("val_loss", loss, sync_dist=True)

        def on_train_epoch_end(self):   # what only this rank saw: its own batches
            self.log("batches", float(self.trainer.num_training_batches))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Announce(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            print(f"rank {trainer.global_rank} ended epoch {trainer.current_epoch}",
                  flush=True)

    torch.manual_seed(0)
    model = Regression()
    out = io.StringIO()
    keep_best = pl.callbacks.ModelCheckpoint(monitor="val_loss", mode="min",
                                             filename="best")
    est = TorchEstimator(backend=SparkBackend(num_proc=2, stdout=out), store=store,
                         model=model, feature_cols=["features"], label_cols=["y"],
                         input_shapes=[[-1, 1, 3]], validation=0.2, batch_size=16,
                         epochs=2, run_id="light1", random_seed=1,
                         callbacks=[Announce(), keep_best], reader_pool_type="thread")
    fitted = est.fit(df)
    assert isinstance(fitted, TorchModel) and fitted.getRunId() == "light1"
    history = fitted.getHistory()
    assert sorted(history) == ["batches", "train_loss", "val_loss"], history
    assert all(len(v) == 2 for v in history.values()), history
    # each rank: its half of the training rows, in whole batches of 16
    from ddl.spark._data import _rows
    train_rows = _rows(store, store.get_train_data_path())
    assert 300 < train_rows < 450
    assert history["batches"] == [float(train_rows // 2 // 16)] * 2, (train_rows, history)
    assert history["train_loss"][1] < history["train_loss"][0], history
    lines = out.getvalue().splitlines()
    for r in (0, 1):
        for e in (0, 1):
            assert f"[{r}]<stdout>:rank {r} ended epoch {e}" in lines, lines
    assert any(line.startswith("[0]<stdout>:epoch 2/2: batches") for line in lines), lines
    assert not any(line.startswith("[1]<stdout>:epoch") for line in lines), lines
    assert store.exists(store.get_checkpoint_path("light1"))
    assert os.path.exists(os.path.join(store.get_run_path("light1"), "best.ckpt"))
    assert store.exists(os.path.join(store.get_logs_path("light1"), "metrics.csv"))
    # the same run_id with more epochs resumes after the checkpoint's last epoch
    more = est.setEpochs(5).fit(df)
    longer = more.getHistory()
    assert longer["train_loss"][:2] == history["train_loss"] and \
        len(longer["train_loss"]) == 5, longer
    # the result is the user's ModelCheckpoint's best (lowest val_loss) epoch
    best = torch.load(os.path.join(store.get_run_path("light1"), "best.ckpt"),
                      weights_only=False)
    assert best["callbacks"] and best["epoch"] == int(np.argmin(longer["val_loss"])), \
        (best["epoch"], longer["val_loss"])
    np.testing.assert_array_equal(more.getModel().linear.weight.detach().numpy(),
                                  best["state_dict"]["linear.weight"].numpy())
    w = more.getModel().linear.weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, [2.0, -1.0, 0.5], atol=0.15)
    pred = more.transform(df.limit(8)).toPandas()
    assert list(pred.columns) == ["features", "y", "w", "y__output"]
    np.testing.assert_allclose(pred["y__output"], pred["y"], atol=0.4)

    # Horovod's legacy use: a plain module, its optimizer, a loss and a metric, weights
    plain = torch.nn.Linear(3, 1)

    def mae(output, label):
        return (output - label).abs().mean()

    legacy = TorchEstimator(num_proc=2, store=store, model=plain,
                            optimizer=torch.optim.SGD(plain.parameters(), lr=0.05),
                            loss=torch.nn.MSELoss(reduction="none"), metrics=[mae],
                            sample_weight_col="w", feature_cols=["features"],
                            label_cols=["y"], validation=0.2, batch_size=16, epochs=3,
                            verbose=0, run_id="light2").fit(df)
    h = legacy.getHistory()
    assert sorted(h) == ["loss", "mae", "val_loss", "val_mae"] and len(h["loss"]) == 3, h
    assert h["loss"][-1] < h["loss"][0] / 4, h
    np.testing.assert_allclose(legacy.getModel().weight.detach().numpy().ravel(),
                               [2.0, -1.0, 0.5], atol=0.3)
    assert legacy.getOptimizer().state_dict()["param_groups"][0]["lr"] == 0.05

    # bad input, named on the driver before any task starts
    for make, message in [
            (lambda: TorchEstimator(num_proc=2, store=store, model=model, loss=mae,
                                    feature_cols=["features"], label_cols=["y"]).fit(df),
             "loss given with a LightningModule, which brings its own"),
            (lambda: TorchEstimator(num_proc=2, store=store, model=plain, loss=mae,
                                    feature_cols=["features"], label_cols=["y"]).fit(df),
             "a plain torch.nn.Module needs optimizer"),
            (lambda: TorchEstimator(num_proc=2, store=store, model="net",
                                    feature_cols=["features"], label_cols=["y"]).fit(df),
             "model must be a lightning.pytorch.LightningModule"),
            (lambda: TorchEstimator(data_module=object), "data_module is not supported here")]:
        with pytest.raises(ValueError) as info:
            make()
        assert message in str(info.value), (message, str(info.value))
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []


def test_a_sample_weighted_loss_is_horovods():
    """With sample_weight_col, a loss function that takes ``reduction`` is called with
    ``reduction='none'`` (as Horovod calls it), and the batch's loss is the mean of the
    rows' losses times their weights (Horovod's, not a weighted average)."""
    import torch
    from ddl.spark.torch import loss_of

    out, lab = torch.tensor([[1.0], [2.0], [3.0]]), torch.zeros(3, 1)
    for f in (torch.nn.functional.mse_loss, torch.nn.MSELoss(reduction="none")):
        spec = {"losses": [f], "loss_weights": None, "label_shapes": None, "who": "t"}
        loss, _, _ = loss_of(spec, torch.nn.Identity(), [out], [lab], [1.0, 2.0, 0.0])
        assert float(loss) == pytest.approx((1 * 1 + 4 * 2 + 9 * 0) / 3)
    spec["losses"] = [torch.nn.MSELoss()]
    with pytest.raises(ValueError, match="t: with sample_weight_col the loss must give one "
                                         "value per row: make it with reduction='none'"):
        loss_of(spec, torch.nn.Identity(), [out], [lab], [1.0, 2.0, 0.0])


def test_horovods_accessors_of_ignored_keywords_and_model_keywords():
    """The reader keywords taken and ignored have Horovod's getX/setX too (its singular
    ``getTrainReaderNumWorker`` included), and a model takes Horovod's own keywords
    (``feature_columns``, ``label_columns``, ``_metadata``)."""
    import torch
    from ddl.spark.lightning import TorchEstimator as LightningEstimator
    from ddl.spark.torch import TorchEstimator, TorchModel

    for cls in (TorchEstimator, LightningEstimator):
        est = cls(num_proc=2, model=torch.nn.Linear(2, 1), mp_start_method="spawn",
                  train_reader_num_workers=3)
        assert est.getMpStartMethod() == "spawn"
        assert est.setMpStartMethod("forkserver") is est
        assert est.getMpStartMethod() == "forkserver"
        assert est.getTrainReaderNumWorker() == 3 and est.getInmemoryCacheAll() is None
    model = TorchModel(history=None, model=torch.nn.Linear(2, 1), input_shapes=[[-1, 2]],
                       feature_columns=["features"], label_columns=["y"], _metadata={})
    assert model.getFeatureColumns() == ["features"] and model.getLabelCols() == ["y"]
    assert model.getOutputCols() == ["y__output"]
    # Horovod's models take a row's shape too (they reshape row by row)
    import numpy as np
    from ddl.spark.torch import to_tensors
    assert [tuple(t.shape) for t in to_tensors([np.ones((3, 2)), np.ones((1, 2))],
                                               [[2], [2]])] == [(3, 2), (2,)]
