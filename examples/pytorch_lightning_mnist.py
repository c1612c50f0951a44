"""PyTorch Lightning on ddl: an MNIST-shaped classifier trained with ``DDLStrategy``.

    ddlrun -np 2 python examples/pytorch_lightning_mnist.py --epochs 2

The script is a single-process Lightning script; the one change is the Trainer's
``strategy=DDLStrategy()``. ``--strategy ddp`` runs it with Lightning's own DDP instead
(``python examples/pytorch_lightning_mnist.py --strategy ddp``: Lightning starts the
processes), for comparison.
The data is synthetic (a fixed random set of MNIST-shaped images whose label depends on
the pixels), so it needs no download. ``--save FILE`` writes the trained weights (rank 0),
``--ranks-differ`` starts each rank from other weights (the strategy broadcasts rank 0's).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl


class Classifier(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self(x).argmax(1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)   # averaged over the ranks

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class ManualClassifier(Classifier):
    """The same model, stepped by hand (manual optimization): gradients accumulated over
    ``accumulate`` batches, clipped to ``clip``, then one step."""

    def __init__(self, lr: float, accumulate: int, clip):
        super().__init__(lr)
        self.automatic_optimization = False
        self.accumulate, self.clip = accumulate, clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            if self.clip is not None:
                self.clip_gradients(opt, gradient_clip_val=self.clip,
                                    gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss, sync_dist=True)


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g)
    y = (x[:, 0, :14].mean((1, 2)) * 40).long() % 10   # a label the pixels decide
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    p.add_argument("--strategy", choices=["ddl", "ddp", "auto"], default="ddl",
                   help="ddp: Lightning's own DDP (Gloo), starting --ddp-processes itself")
    p.add_argument("--ddp-processes", type=int, default=2)
    p.add_argument("--save", default="", help="write the trained weights here (rank 0)")
    p.add_argument("--ranks-differ", action="store_true")
    p.add_argument("--manual", action="store_true",
                   help="manual optimization (the same accumulation and clipping)")
    p.add_argument("--refit", action="store_true",
                   help="after fit: validate, then fit again with a new Trainer")
    args = p.parse_args()

    strategy, devices, rank = args.strategy, "auto", 0
    if args.strategy == "ddl":
        from ddl.torch.lightning import DDLStrategy
        strategy = DDLStrategy()
        rank = strategy.global_rank
    elif args.strategy == "ddp":
        devices, rank = args.ddp_processes, int(os.environ.get("LOCAL_RANK", 0))
    torch.manual_seed(1 + (rank if args.ranks_differ else 0))
    model = (ManualClassifier(args.lr, args.accumulate, args.clip) if args.manual
             else Classifier(args.lr))
    stepping = {"accumulate_grad_batches": 1, "gradient_clip_val": None} if args.manual \
        else {"accumulate_grad_batches": args.accumulate, "gradient_clip_val": args.clip}
    train = DataLoader(dataset(args.samples, 0), batch_size=args.batch_size)
    val = DataLoader(dataset(256, 1), batch_size=64)

    def new_trainer():
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                          max_epochs=args.epochs, **stepping, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
    trainer = new_trainer()
    trainer.fit(model, train, val)
    validated, steps = None, 0
    if args.refit:   # a second stage: validate, then train on with a new Trainer
        validated = trainer.validate(model, val, verbose=False)[0]["val_accuracy"]
        steps = trainer.global_step
        if args.strategy == "ddl":
            strategy = DDLStrategy()
        trainer = new_trainer()
        trainer.fit(model, train, val)
    # what the ranks saw, checked by tests/test_lightning.py
    gathered = trainer.strategy.all_gather(torch.tensor([float(trainer.global_rank)]))
    x = torch.ones(2, requires_grad=True)   # a gathered tensor's gradient, as contrastive
    trainer.strategy.all_gather(x, sync_grads=True).sum().backward()   # losses use it
    summary = {"rank": trainer.global_rank, "world_size": trainer.world_size,
               "steps": steps + trainer.global_step, "validated": validated,
               "val_accuracy": float(trainer.callback_metrics["val_accuracy"]),
               "gathered": gathered.flatten().tolist(), "gather_grad": x.grad.tolist(),
               "root_says": trainer.strategy.broadcast(f"hello from {trainer.global_rank}"),
               "weights_sum": float(sum(p.detach().double().sum() for p in model.parameters()))}
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.save and trainer.is_global_zero:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
