"""PyTorch Lightning's Trainer on ddl (``ddl.torch.lightning.DDLStrategy``), against
Lightning's own DDP on the same script, data and settings."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

if importlib.util.find_spec("lightning") is None:  # (not imported here: the ranks do)
    pytest.skip("needs PyTorch Lightning (pip install 'lightning>=2.1')",
                allow_module_level=True)

from test_launcher_support import ddlrun, job_env  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "pytorch_lightning_mnist.py")
# two ranks of 8 images; gradients accumulated over 2 batches, then clipped: both act on
# the averaged gradients only if they are reduced before Lightning clips
ARGS = ["--epochs", "1", "--samples", "128", "--batch-size", "8", "--accumulate", "2",
        "--clip", "0.5", "--ranks-differ"]


def _summaries(out: str) -> list:
    # (DDP's two processes share one stdout: their lines may run together)
    rows = [json.loads(m.group(1)) for m in re.finditer(r"SUMMARY (\{[^{}]*\})", out)]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.timeout(300)
def test_trainer_fit_on_ddl_equals_lightnings_ddp(tmp_path):
    """Under ``ddlrun -np 2``, ``Trainer(strategy=DDLStrategy())`` (each rank starting from
    other weights) trains to the weights Lightning's DDP reaches from rank 0's, with the
    same steps, in automatic and in manual optimization; ``self.log(sync_dist=True)``,
    ``all_gather`` (and its gradient), ``broadcast`` agree; rank-zero messages come from
    rank 0 alone; a ``strategy="ddl"`` string names it once the module is imported. In
    automatic optimization the script then validates and fits again with a new Trainer
    (a second stage: the first Trainer's optimizers must reduce nothing more)."""
    import torch
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    for mode in (["--refit"], ["--manual"]):
        ours, theirs = tmp_path / "ddl.pt", tmp_path / "ddp.pt"
        r = ddlrun(["-np", "2", sys.executable, EXAMPLE, *ARGS, *mode, "--save", str(ours)],
                   job_env(tmp_path), timeout=200)
        assert r.returncode == 0, r.stderr[-3000:]
        got = _summaries(r.stdout)
        ref = subprocess.run([sys.executable, EXAMPLE, *ARGS, *mode, "--strategy", "ddp",
                              "--save", str(theirs)], capture_output=True, text=True,
                             timeout=200, env=env, cwd=str(tmp_path))
        assert ref.returncode == 0, ref.stderr[-3000:]
        want = _summaries(ref.stdout)

        # 128 images / 2 ranks / 8 per batch = 8 batches, a step every 2 (each fit)
        steps = 8 if mode == ["--refit"] else 4
        assert [g["steps"] for g in got] == [w["steps"] for w in want] == [steps] * 2, \
            (got, want)
        if mode == ["--refit"]:   # Trainer.validate between the fits, with sync_dist
            assert got[0]["validated"] == got[1]["validated"], got
            assert abs(got[0]["validated"] - want[0]["validated"]) < 1e-6, (got, want)
        for g, w in zip(got, want):
            assert g["world_size"] == 2 and g["gathered"] == [0.0, 1.0], g
            assert g["root_says"] == "hello from 0", g
            assert g["gather_grad"] == w["gather_grad"] == [2.0, 2.0], (g, w)
        assert got[0]["weights_sum"] == got[1]["weights_sum"], got   # the ranks stay equal
        assert got[0]["val_accuracy"] == got[1]["val_accuracy"], got  # logged with sync_dist
        assert abs(got[0]["val_accuracy"] - want[0]["val_accuracy"]) < 1e-6, (got, want)
        a, b = torch.load(ours), torch.load(theirs)
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        assert diff < 1e-5, f"{mode}: ddl's weights differ from DDP's by {diff}"
        # Lightning's rank-zero-only messages: rank 0's alone
        assert "[0]<stderr>:GPU available" in r.stderr, r.stderr[-2000:]
        assert "[1]<stderr>:GPU available" not in r.stderr, r.stderr[-2000:]

    check = ("import lightning.pytorch as pl, ddl.torch.lightning as m\n"
             "from lightning.pytorch.strategies import StrategyRegistry\n"
             "assert issubclass(StrategyRegistry['ddl']['strategy'], m.DDLStrategy)\n")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # Lightning under its older name (pytorch_lightning, whose classes the other's Trainer
    # refuses, and the reverse): the same DDLStrategy() fits there, without importing the
    # other package; strategy="ddl" too
    check = ("import sys, torch, pytorch_lightning as pl\n"
             "import ddl.torch.lightning as m\n"
             "assert 'lightning.pytorch' not in sys.modules\n"
             "class Tiny(pl.LightningModule):\n"
             "    def __init__(self):\n"
             "        super().__init__(); self.w = torch.nn.Linear(2, 1)\n"
             "    def training_step(self, batch, i):\n"
             "        return self.w(batch[0]).pow(2).mean()\n"
             "    def configure_optimizers(self):\n"
             "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
             "data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset("
             "torch.ones(8, 2)), batch_size=4)\n"
             "for strategy in (m.DDLStrategy(), 'ddl'):\n"
             "    t = pl.Trainer(strategy=strategy, accelerator='cpu', max_epochs=1, "
             "logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
             "    t.fit(Tiny(), data)\n"
             "    assert isinstance(t.strategy, m.DDLStrategy) and t.global_step == 2\n"
             "assert m.lightning_package(Tiny()) == 'pytorch_lightning'\n"
             "assert 'lightning.pytorch' not in sys.modules\n"
             "print('pytorch_lightning ok')\n")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and "pytorch_lightning ok" in out.stdout, out.stderr[-2000:]
