"""SyncBatchNorm: batch normalization with statistics over the batches of all ranks.

A drop-in for ``torch.nn.BatchNorm1d/2d/3d``. In training, each forward allreduces the
per-channel count, sum and sum of squares of this rank's batch (one call), so every rank
normalizes with the global mean and variance and updates the running statistics with
them; backward allreduces the two per-channel sums the input gradient needs (one call).
The weight and bias gradients stay local (the DistributedOptimizer averages them). In
eval mode, or with one rank, it is plain batch normalization.

Cross-rank contract: every rank runs the layer the same number of times, in the same
order, in forward and backward (as a data-parallel model does); the collectives are
named after the layer's creation index (``sync_batch_norm.<i>``), so every rank must
create its SyncBatchNorm layers in the same order. Batches may differ in size per rank.
"""

from __future__ import annotations

import itertools

import torch

import ddl
from ddl import ProcessSet, ReduceOp, global_process_set

_counter = itertools.count()


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, name,
                process_set):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.detach().to(torch.float64)
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                           torch.full((1,), float(x.numel() // c), dtype=torch.float64,
                                      device=x.device)])
        total = ddl.allreduce(local, name=f"{name}/stats", op=ReduceOp.Sum,
                              process_set=process_set)
        n = float(total[-1])
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * (n / max(n - 1.0, 1.0))
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype) * momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt()
        xhat = ((xf - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        out = xhat
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
        ctx.args = (n, name, process_set, dims, shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        xhat, weight, invstd = ctx.saved_tensors
        n, name, process_set, dims, shape = ctx.args
        c = xhat.shape[1]
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * xhat).sum(dims)
        total = ddl.allreduce(torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64),
                              name=f"{name}/grad", op=ReduceOp.Sum, process_set=process_set)
        g_sum, g_xhat = total[:c].to(grad.dtype), total[c:].to(grad.dtype)
        scale = invstd if weight is None else invstd * weight
        grad_x = (grad - (g_sum.view(shape) + xhat * g_xhat.view(shape)) / n) * \
            scale.view(shape)
        grad_w = sum_dy_xhat if weight is not None else None
        grad_b = sum_dy if weight is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over all ranks' batches (see the module doc).

    Same arguments as ``torch.nn.BatchNorm2d``, plus ``process_set``. Takes inputs of
    2 to 5 dimensions, channels in dim 1.

    Example::

        model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), ddl.torch.SyncBatchNorm(8))
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set
        self._ddl_name = f"sync_batch_norm.{next(_counter)}"

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got "
                             f"{x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        training = self.training or not self.track_running_stats
        if not training or self.process_set.size() == 1:
            return super().forward(x)
        momentum = self.momentum if self.momentum is not None else 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch does
                momentum = 1.0 / float(self.num_batches_tracked)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(
            x, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, momentum, self._ddl_name,
            self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """``module`` with every BatchNorm*d replaced by a SyncBatchNorm (same state)."""
        out = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and \
                not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight.copy_(module.weight)
                    out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean = module.running_mean
                out.running_var = module.running_var
                out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for child_name, child in module.named_children():
            out.add_module(child_name, cls.convert_sync_batchnorm(child, process_set))
        return out
