"""The autograd Functions behind the differentiable torch collectives
(:mod:`ddl.torch._ops`), with Horovod 0.28's gradients.

The gradient of an allreduce is the same allreduce of the incoming gradient (Sum or
Average, with the same scale factors); of an allgather, this rank's rows of the
members' average incoming gradient; of a broadcast, the members' average on the root
and zero elsewhere; of a reducescatter, the incoming gradients gathered (times the scale
factors, and times the members' number for Sum); of an alltoall, the alltoall of the
gradient back to where each row came from. The grouped ops do as their single ones, in
one grouped call.

Cross-rank contract: the backward collectives are named after the forward one
(``<name>/grad``), so every member must run backward through the same calls.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

import ddl
from ddl import ReduceOp

Average, Sum = ReduceOp.Average, ReduceOp.Sum


def grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}/grad"


def linear(op: ReduceOp, what: str) -> None:
    """NotImplementedError unless ``op`` is linear (Sum, Average): the only reductions
    whose gradient is defined here."""
    if op not in (Sum, Average):
        raise NotImplementedError(f"the gradient of {what} with {op.name} is not defined "
                                  f"here (only Sum and Average)")


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (name, op, prescale, postscale, process_set)
        return ddl.allreduce(tensor.detach(), name=name, op=op, prescale_factor=prescale,
                             postscale_factor=postscale, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, process_set = ctx.args
        linear(op, "an allreduce")
        out = ddl.allreduce(grad.contiguous(), name=grad_name(name), op=op,
                            prescale_factor=prescale, postscale_factor=postscale,
                            process_set=process_set)
        return out, None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (name, op, prescale, postscale, process_set)
        return tuple(ddl.grouped_allreduce([t.detach() for t in tensors], name=name, op=op,
                                           prescale_factor=prescale,
                                           postscale_factor=postscale,
                                           process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, process_set = ctx.args
        linear(op, "a grouped allreduce")
        outs = ddl.grouped_allreduce([g.contiguous() for g in grads], name=grad_name(name),
                                     op=op, prescale_factor=prescale,
                                     postscale_factor=postscale, process_set=process_set)
        return (None,) * 5 + tuple(outs)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.args = (name, process_set)
        # the call's own name first: another rank's call of it (a refused one too) meets it
        out = ddl.allgather(tensor.detach(), name=name, process_set=process_set)
        rows = np.array([tensor.shape[0]], dtype=np.int64)
        ctx.rows = ddl.allgather(rows, name=None if name is None else f"{name}/rows",
                                 process_set=process_set)
        return out

    @staticmethod
    def backward(ctx, grad):   # Horovod's: this rank's rows of the average gradient
        name, process_set = ctx.args
        total = ddl.allreduce(grad.contiguous(), name=grad_name(name), op=Average,
                              process_set=process_set)
        me = process_set.rank()
        start = int(ctx.rows[:me].sum())
        return total[start:start + int(ctx.rows[me])], None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return ddl.broadcast(tensor.detach(), root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):   # Horovod's: the average gradient on the root, 0 elsewhere
        root_rank, name, process_set = ctx.args
        total = ddl.allreduce(grad.contiguous(), name=grad_name(name), op=Average,
                              process_set=process_set)
        if ddl.rank() != root_rank:
            total = torch.zeros_like(total)
        return total, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.args = (name, process_set)
        out, received = ddl.alltoall(tensor.detach(), splits=splits, name=name,
                                     process_set=process_set)
        ctx.received = [int(r) for r in received]
        received = torch.from_numpy(np.asarray(received))
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        name, process_set = ctx.args   # each row's gradient goes back where it came from
        back, _ = ddl.alltoall(grad.contiguous(), splits=ctx.received,
                               name=grad_name(name), process_set=process_set)
        return back, None, None, None


class GroupedAllgather(torch.autograd.Function):
    """Each input's gradient is this rank's rows of the members' average output gradient,
    as :class:`Allgather`'s, all reduced in one group."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.args = (name, process_set)
        outs = ddl.grouped_allgather([t.detach() for t in tensors], name=name,
                                     process_set=process_set)
        rows = np.array([[t.shape[0] for t in tensors]], dtype=np.int64)
        ctx.rows = ddl.allgather(rows, name=None if name is None else f"{name}/rows",
                                 process_set=process_set)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        name, process_set = ctx.args
        totals = ddl.grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                       name=grad_name(name), process_set=process_set)
        me = process_set.rank()
        starts = ctx.rows[:me].sum(axis=0)
        return (None, None) + tuple(t[int(starts[i]):int(starts[i]) + int(ctx.rows[me, i])]
                                    for i, t in enumerate(totals))


class Reducescatter(torch.autograd.Function):
    """A reducescatter (``grouped``: of several tensors); the gradient of a member's input
    is every member's output gradient, gathered in member order (its block), times the
    scale factors, and times the members' number for Sum: Horovod's convention (true
    gradients for Average, ``size()`` times them for Sum)."""

    @staticmethod
    def forward(ctx, grouped, kwargs, *tensors):
        ctx.grouped, ctx.kwargs = grouped, kwargs
        return tuple(reducescatter_detached(tensors, grouped, kwargs))

    @staticmethod
    def backward(ctx, *grads):
        kw = ctx.kwargs
        op, process_set = kw["op"], kw["process_set"]
        linear(op, "a reducescatter")
        scale = kw["prescale_factor"] * kw["postscale_factor"] * (
            process_set.size() if op == Sum else 1)
        grads = [g.contiguous() for g in grads]
        name = grad_name(kw["name"])
        outs = (ddl.grouped_allgather(grads, name=name, process_set=process_set)
                if ctx.grouped else
                [ddl.allgather(grads[0], name=name, process_set=process_set)])
        return (None, None) + tuple(o * scale if scale != 1 else o for o in outs)


def reducescatter_detached(tensors, grouped: bool, kwargs) -> list:
    tensors = [t.detach() for t in tensors]
    return (ddl.grouped_reducescatter(tensors, **kwargs) if grouped else
            [ddl.reducescatter(tensors[0], **kwargs)])
