"""Training scripts written for Horovod, with only the import line changed
(examples/horovod_compat/: PyTorch, TensorFlow 2, Keras), run under ddlrun with
horovodrun's flags and HOROVOD_* variables: each trains, its ranks end with the same
weights, and ddlrun says once which Horovod settings it read or ignored."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_launcher_support import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, needs", [("pytorch_train", "torch"),
                                           ("tensorflow2_train", "tensorflow"),
                                           ("keras_train", "keras")])
def test_a_horovod_script_runs_with_only_the_import_changed(tmp_path, script, needs):
    pytest.importorskip(needs)
    env = job_env(tmp_path, HOROVOD_FUSION_THRESHOLD="33554432", HOROVOD_CYCLE_TIME="5",
                  HOROVOD_STALL_CHECK_TIME_SECONDS="30")
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    r = subprocess.run([os.path.join(BIN, "ddlrun"), "-np", "2", "--hierarchical-allreduce",
                        "--cycle-time-ms", "5", "--prefix-output-with-timestamp",
                        sys.executable, f"examples/horovod_compat/{script}.py"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=280,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"[0]<stdout>:HOROVOD SCRIPT OK: {script.split('_')[0].replace('2', '')}" in r.stdout
    notes = [line for line in r.stderr.splitlines() if line.startswith("ddlrun: note:")]
    # --cycle-time-ms set DDL_CYCLE_TIME_MS, to HOROVOD_CYCLE_TIME's value: nothing to say
    assert notes == ["ddlrun: note: read as ddl settings: HOROVOD_FUSION_THRESHOLD as "
                     "DDL_FUSION_THRESHOLD, HOROVOD_STALL_CHECK_TIME_SECONDS as "
                     "DDL_STALL_CHECK_TIME_SECONDS"], r.stderr[-2000:]


def test_horovods_module_paths_import_under_ddl():
    """A script whose ``horovod`` imports are renamed mechanically to ``ddl`` finds the
    same modules: ``ddl.tensorflow.keras`` (is ``ddl.keras``), its ``callbacks`` and
    ``elastic``, and ``ddl.torch.elastic.sampler`` / ``.state``; and the clients have
    Horovod's ``HorovodInternalError`` (ddl's FatalError)."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("torch")
    code = (
        "import ddl.keras, ddl.tensorflow.keras as hvd\n"
        "from ddl.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback\n"
        "from ddl.tensorflow.keras.elastic import KerasState, CommitStateCallback\n"
        "import ddl.torch.elastic\n"
        "from ddl.torch.elastic.sampler import ElasticSampler\n"
        "from ddl.torch.elastic.state import TorchState\n"
        "assert hvd is ddl.keras and BroadcastGlobalVariablesCallback is "
        "ddl.keras.callbacks.BroadcastGlobalVariablesCallback\n"
        "assert ElasticSampler is ddl.torch.elastic.ElasticSampler\n"
        "assert TorchState is ddl.torch.elastic.TorchState\n"
        "import ddl, ddl.tensorflow\n"   # Horovod's error name, caught by elastic loops
        "assert ddl.torch.HorovodInternalError is ddl.tensorflow.HorovodInternalError "
        "is ddl.FatalError\n"
        "try:\n"   # Horovod's Keras name, which TensorFlow 2 refuses: saying what to use
        "    hvd.broadcast_global_variables(0)\n"
        "except RuntimeError as e:\n"
        "    assert 'BroadcastGlobalVariablesCallback(0)' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('broadcast_global_variables did not raise')\n"
        # horovod.tensorflow's DistributedOptimizer hands a Keras optimizer to the Keras one
        "import keras, numpy as np\n"
        "ddl.tensorflow.init()\n"
        "opt = ddl.tensorflow.DistributedOptimizer(keras.optimizers.SGD(0.1), "
        "compression=ddl.tensorflow.Compression.fp16, backward_passes_per_step=1)\n"
        "assert isinstance(opt, keras.optimizers.SGD) and opt._ddl_wrapped, opt\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "m.compile(optimizer=opt, loss='mse')\n"
        "m.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)\n"
        "try:\n"
        "    ddl.tensorflow.DistributedOptimizer('sgd')\n"
        "except ValueError as e:\n"
        "    assert 'or a Keras optimizer; got str' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('a string was taken for an optimizer')\n"
        "print('paths ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "paths ok" in r.stdout, r.stderr[-3000:]
