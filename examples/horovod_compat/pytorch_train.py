"""A PyTorch training script written for Horovod; only the import line differs
(``import horovod.torch as hvd`` in the original). Run it as horovodrun would:

    HOROVOD_FUSION_THRESHOLD=33554432 ddlrun -np 2 --hierarchical-allreduce \\
        --cycle-time-ms 5 python examples/horovod_compat/pytorch_train.py
"""

import argparse
import os

import torch
import torch.nn.functional as F

import ddl.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batches", type=int, default=20)
parser.add_argument("--fp16-allreduce", action="store_true")
args = parser.parse_args()

hvd.init()
# what Horovod's launchers set, which scripts read (ddl.init() sets them too)
assert (int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"]),
        int(os.environ["HOROVOD_LOCAL_RANK"])) == (hvd.rank(), hvd.size(), hvd.local_rank())
torch.manual_seed(1234 + hvd.rank())  # different data and initial weights per rank
torch.set_num_threads(1)

model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average,
                                     backward_passes_per_step=1)

w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
for epoch in range(1, args.epochs + 1):
    total = torch.zeros(())
    for _ in range(args.batches):
        x = torch.randn(32, 20)
        y = (x @ w_true).argmax(dim=1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.detach()
    avg = hvd.allreduce(total / args.batches, name="avg_loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {avg.item():.4f} on {hvd.size()} ranks "
              f"(nccl_built={hvd.nccl_built()}, mpi_built={hvd.mpi_built()})", flush=True)

# every rank holds the same model
digest = torch.cat([p.detach().flatten() for p in model.parameters()]).sum()
same = hvd.allgather(digest.reshape(1), name="digest")
assert torch.allclose(same, same[0].expand_as(same)), same
if hvd.rank() == 0:
    print("HOROVOD SCRIPT OK: pytorch", flush=True)
