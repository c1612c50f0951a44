"""DistributedOptimizer: a torch optimizer whose gradients are allreduced as they appear.

Wrapping keeps the optimizer object (its state, param groups and type: LR schedulers and
``isinstance`` checks still work) and gives it a subclass that adds the communication:

* a hook on every parameter fires when its gradient has been accumulated in ``backward``
  and starts an asynchronous allreduce of it at once, so communication overlaps the rest
  of the backward pass; with ``backward_passes_per_step=k`` it fires on every k-th pass
  (gradients accumulate in between, as torch does; scale the loss by 1/k for a mean);
* ``step()`` first waits for every allreduce (``synchronize()``) and writes the averaged
  gradients into ``p.grad``, then runs the original step.

With ``op=Adasum`` the wrapper is Horovod's Adasum optimizer instead: no hooks; ``step()``
takes the local step, then Adasum-combines the parameters' changes
(:class:`_DistributedAdasumOptimizer`).

Cross-rank contract: every rank wraps the same parameters under the same names (from
``named_parameters``, else by position in the param groups) with the same settings, and
calls ``step()`` (or ``synchronize()``) the same number of times. A parameter that got
no gradient on this rank in a step is allreduced as zeros, so the others do not wait for
it forever. A later DistributedOptimizer over all of the same parameters (and maybe more)
replaces this one: its hooks are removed and its ``step()`` raises
:class:`~ddl.DDLError`.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch

import ddl
from ddl import DDLError, FatalError, ProcessSet, ReduceOp, global_process_set
from ddl._client_api import Compressor

from ddl.torch._compression import Compression
from ddl.torch._ops import sparse_allreduce_async

Average, Sum = ReduceOp.Average, ReduceOp.Sum

# id(parameter) -> (the parameter, the DistributedOptimizer that reduces it now: the
# latest one to wrap it), both weak; by id, as a tensor's == compares elements
_OWNERS: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


def _claim(opt, params) -> None:
    """Make ``opt`` the optimizer that reduces ``params``: an earlier DistributedOptimizer
    whose parameters are all among them is retired (its hooks removed, its ``step()``
    refused), so that making a new optimizer over a model's parameters (for a new phase
    of training, or after an elastic reset) never leaves the old one reducing them too.
    One that shares only some of them (another task's head beside a shared encoder)
    keeps working: both reduce the shared ones, under their own names."""
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]
    mine = {id(p) for p in params}
    olds = {}
    for p in params:
        found = _OWNERS.get(id(p))
        old = found[1]() if found is not None and found[0]() is p else None
        if old is not None and old is not opt and not old._ddl_retired:
            olds.setdefault(id(old), (old, p))
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(opt))
    for old, p in olds.values():
        if all(id(q) in mine for q in old._ddl_names):
            old._ddl_retire(opt, p)


class _Retirable:
    """What both wrappers share: retirement by a later DistributedOptimizer."""

    _ddl_retired = ""
    _ddl_hooks: list = []

    def _ddl_retire(self, by, p) -> None:
        self._ddl_detach(
            f"DistributedOptimizer: this optimizer was replaced by a later "
            f"DistributedOptimizer ({type(by).__name__}) over all of its parameters "
            f"('{self._ddl_names.get(p, '?')}' among them), which reduces their gradients "
            f"now; this one no longer does. Call step() on the new optimizer")

    def _ddl_detach(self, why: str) -> None:
        """Stop reducing: the hooks go, and ``step()`` raises ``why`` from now on."""
        for hook in self._ddl_hooks:
            hook.remove()
        self._ddl_hooks = []
        # reductions its hooks started (made between backward() and step()) end first:
        # the new optimizer reduces the same gradients again, under the same names
        for handle, _ in getattr(self, "_ddl_handles", {}).values():
            try:
                handle.wait()
            except DDLError:
                pass
        self._ddl_forget()
        self._ddl_retired = why

    def _ddl_check_retired(self) -> None:
        if self._ddl_retired:
            raise DDLError(self._ddl_retired)


def _exchanges(process_set: ProcessSet) -> bool:
    """Whether an optimizer over ``process_set`` reduces anything on this rank: the set has
    other ranks, and this one is among them."""
    return process_set.size() > 1 and process_set.included()


class _DistributedOptimizer(_Retirable):
    """Mixed in front of the wrapped optimizer's class (see the module doc)."""

    def _ddl_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense,
                   process_set: ProcessSet) -> None:
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, numbers.Integral)
                or backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                             f"{backward_passes_per_step!r}")
        op = ReduceOp(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        self._ddl_compression = compression
        self._ddl_passes = int(backward_passes_per_step)
        self._ddl_op = op
        self._ddl_predivide = float(gradient_predivide_factor)
        self._ddl_sparse_as_dense = bool(sparse_as_dense)
        self._ddl_process_set = process_set
        self._ddl_names = _parameter_names(self, named_parameters)
        self._ddl_groups = _parameter_groups(self, groups)
        self._ddl_group_of = {p: i for i, g in enumerate(self._ddl_groups) for p in g}
        self._ddl_ready: Dict[int, List[torch.nn.Parameter]] = {}
        self._ddl_counts: Dict[torch.nn.Parameter, int] = {}
        self._ddl_handles: Dict[torch.nn.Parameter, Tuple[object, object]] = {}
        self._ddl_synchronized = False
        self._ddl_should_synchronize = True
        _claim(self, self._ddl_names)
        self._ddl_hooks = [p.register_post_accumulate_grad_hook(self._ddl_hook)
                           for p in self._ddl_names if p.requires_grad]

    @property
    def _ddl_active(self) -> bool:
        """A set of one rank has nothing to exchange, nor one this rank is not in (it
        steps alone, as Horovod's). Asked at each use: an elastic job's world changes
        size under the optimizer."""
        return _exchanges(self._ddl_process_set)

    def _ddl_forget(self) -> None:
        """Drop every pending reduction after a fatal error (a lost rank): the next step,
        in an elastic job's next world, starts clean."""
        self._ddl_handles.clear()
        self._ddl_ready.clear()
        self._ddl_counts.clear()
        self._ddl_synchronized = False

    # -- hooks ----------------------------------------------------------------------------
    # while True, the hooks do nothing: gradients accumulate, and synchronize() reduces
    # them all (ddl.torch.lightning: every backward pass but the one in the step's closure)
    _ddl_paused = False

    def _ddl_hook(self, p: torch.nn.Parameter) -> None:
        if self._ddl_paused or not self._ddl_active:
            return
        try:
            self._ddl_hooked(p)
        except FatalError:  # the world is gone (a misuse error keeps what is in flight)
            self._ddl_forget()
            raise

    def _ddl_hooked(self, p: torch.nn.Parameter) -> None:
        if p in self._ddl_handles:
            raise DDLError(
                f"DistributedOptimizer: the gradient of '{self._ddl_names[p]}' was computed "
                f"again before step(); with several backward passes per step, pass "
                f"backward_passes_per_step={self._ddl_passes + 1} or more, or call "
                f"synchronize() in between")
        count = self._ddl_counts.get(p, 0) + 1
        if count < self._ddl_passes:
            self._ddl_counts[p] = count
            return
        self._ddl_counts[p] = 0
        self._ddl_submit(p)

    def _ddl_submit(self, p: torch.nn.Parameter) -> None:
        """Start ``p``'s allreduce, or its group's once the whole group is ready."""
        group = self._ddl_group_of.get(p)
        if group is None:
            self._ddl_handles[p] = self._ddl_allreduce([p])[0]
            return
        ready = self._ddl_ready.setdefault(group, [])
        ready.append(p)
        if len(ready) == len(self._ddl_groups[group]):
            del self._ddl_ready[group]
            for q, h in zip(self._ddl_groups[group], self._ddl_allreduce(
                    self._ddl_groups[group])):
                self._ddl_handles[q] = h

    def _ddl_allreduce(self, params: List[torch.nn.Parameter]):
        """Start the allreduce of ``params``' gradients; one (handle, ctx) per param."""
        # Average divides by the ranks that contribute (not those that joined)
        op, pre, post = self._ddl_op, 1.0 / self._ddl_predivide, self._ddl_predivide
        grads, ctxs = [], []
        for p in params:
            grad, kind = p.grad, "dense"
            if grad.is_sparse:
                if not self._ddl_sparse_as_dense:
                    ctxs.append(("sparse", None))
                    grads.append(grad)
                    continue
                # reduced dense, and sparse again for the step (SparseAdam takes no other)
                grad, kind = grad.to_dense(), "densified"
            wire, cctx = self._ddl_compression.compress(grad)
            grads.append(wire)
            ctxs.append((kind, cctx))
        handles = []
        for p, grad, ctx in zip(params, grads, ctxs):
            name = f"DistributedOptimizer/{self._ddl_names[p]}"
            if ctx[0] == "sparse":
                handles.append((sparse_allreduce_async(grad, name, self._ddl_op,
                                                       self._ddl_process_set), ctx))
            else:
                handles.append((ddl.allreduce_async(
                    grad.detach(), name=name, op=op, prescale_factor=pre,
                    postscale_factor=post, process_set=self._ddl_process_set), ctx))
        return handles

    # -- the optimizer's interface --------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the results into ``p.grad``.

        Parameters whose hook did not fire this step (no gradient here, or a pass count
        short of ``backward_passes_per_step``) are reduced now, as zeros if they have no
        gradient, so that every rank submits the same names.
        """
        self._ddl_check_retired()
        if not self._ddl_active:
            return
        try:
            self._ddl_synchronize()
        except FatalError:
            self._ddl_forget()
            raise

    def _ddl_synchronize(self) -> None:
        for p in self._ddl_names:
            if p.requires_grad and p not in self._ddl_handles and not self._ddl_pending(p):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._ddl_counts[p] = 0
                self._ddl_submit(p)
        for group, ready in list(self._ddl_ready.items()):
            # a group whose hooks did not all fire: its other members were reduced above
            del self._ddl_ready[group]
            for q, h in zip(ready, self._ddl_allreduce(ready)):
                self._ddl_handles[q] = h
        handles, self._ddl_handles = self._ddl_handles, {}
        for p, (handle, (kind, cctx)) in handles.items():
            out = handle.wait()
            with torch.no_grad():
                if kind == "sparse":
                    p.grad = out
                elif kind == "densified":
                    p.grad = self._ddl_compression.decompress(out, cctx).to_sparse()
                else:
                    _take_result(p.grad, self._ddl_compression.decompress(out, cctx))
        self._ddl_synchronized = True

    def _ddl_pending(self, p) -> bool:
        group = self._ddl_group_of.get(p)
        return group is not None and p in self._ddl_ready.get(group, ())

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize: call ``synchronize()`` first
        yourself (to clip or unscale the averaged gradients), then ``step()`` here."""
        self._ddl_should_synchronize = False
        try:
            yield
        finally:
            self._ddl_should_synchronize = True

    def step(self, closure=None):
        self._ddl_check_retired()
        if self._ddl_should_synchronize:
            if self._ddl_synchronized:
                # Horovod's words first: scripts and tests look for them
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): DistributedOptimizer "
                              "synchronizes again, which slows training; wrap step() in "
                              "optimizer.skip_synchronize() to avoid it", stacklevel=2)
            self.synchronize()
        self._ddl_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ddl_handles or self._ddl_ready:
            names = sorted(self._ddl_names[p] for p in self._ddl_handles)[:5]
            raise DDLError(
                f"DistributedOptimizer: zero_grad() was called after backward() and before "
                f"step() or synchronize(), while the gradients of {names} are being "
                f"allreduced; call step() (or synchronize()) first")
        return super().zero_grad(set_to_none)


def _take_result(grad: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``grad`` hold the allreduced ``value``: it takes ``value``'s memory (a new
    result, which nothing else holds) as Horovod's ``set_`` does, saving a copy of every
    gradient per step, where dtype, shape and device agree and ``grad`` owns all of its
    memory (not a view into a flat buffer of gradients, whose other users would then miss
    the result); else a copy."""
    if (value.dtype == grad.dtype and value.shape == grad.shape
            and value.device == grad.device and value.layout == grad.layout
            and grad.layout == torch.strided and grad._base is None
            and grad.storage_offset() == 0 and grad.is_contiguous()
            and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()):
        grad.set_(value)
    else:
        grad.copy_(value)


class _DistributedAdasumOptimizer(_Retirable):
    """Mixed in front of the wrapped optimizer's class for ``op=Adasum`` (Horovod's
    ``_DistributedAdasumOptimizer``): ``step()`` runs the local optimizer's step on this
    rank's own gradients, Adasum-reduces each parameter's change (new - old, per tensor,
    :mod:`ddl.core.adasum`) and sets every parameter to old + the reduced change. The
    parameters must be equal on every rank before (broadcast them); they stay equal.
    ``backward_passes_per_step`` needs nothing here (gradients accumulate locally until
    ``step()``), and ``sparse_as_dense`` neither (the changes are dense)."""

    def _ddl_adasum_setup(self, named_parameters, compression, backward_passes_per_step,
                          groups, process_set: ProcessSet) -> None:
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, numbers.Integral)
                or backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                             f"{backward_passes_per_step!r}")
        if groups is not None:
            raise ValueError("groups= is not supported with op=Adasum: each parameter's "
                             "change is reduced on its own; leave groups unset")
        self._ddl_compression = compression
        self._ddl_process_set = process_set
        self._ddl_names = _parameter_names(self, named_parameters)
        _claim(self, self._ddl_names)

    def _ddl_forget(self) -> None:
        """Nothing is kept between steps."""

    @property
    def _ddl_active(self) -> bool:
        return _exchanges(self._ddl_process_set)  # asked at each step (elastic worlds)

    def synchronize(self) -> None:
        """Nothing to do: with Adasum the gradients stay local and ``step()`` reduces the
        parameters' changes (clipping the local gradients before ``step()`` is fine)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Accepted for code written for op=Average; ``step()`` reduces either way."""
        yield

    def step(self, closure=None):
        self._ddl_check_retired()
        params = [p for p in self._ddl_names if p.requires_grad]
        if not self._ddl_active:
            return super().step(closure)
        with torch.no_grad():
            old = [p.detach().clone() for p in params]
        loss = super().step(closure)
        with torch.no_grad():
            pending = []
            for p, before in zip(params, old):
                wire, ctx = self._ddl_compression.compress(p.detach() - before)
                handle = ddl.allreduce_async(
                    wire, name=f"DistributedAdasumOptimizer/{self._ddl_names[p]}",
                    op=ReduceOp.Adasum, process_set=self._ddl_process_set)
                pending.append((p, before, handle, ctx))
            for p, before, handle, ctx in pending:
                delta = self._ddl_compression.decompress(handle.wait(), ctx)
                p.copy_(before + delta.to(p.dtype))
        return loss


def _parameter_names(opt, named_parameters) -> Dict[torch.nn.Parameter, str]:
    """Every optimizer parameter's name: from ``named_parameters``, else ``param.<i>``."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. "
                         "model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters has duplicate names: {dups}")
    by_param = {p: n for n, p in named}
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise ValueError(f"named_parameters does not name {len(missing)} of the optimizer's "
                         f"parameters (positions {missing[:10]} in its param groups); pass "
                         f"the named_parameters() of the model the optimizer trains")
    return {p: by_param[p] for p in params}


def _parameter_groups(opt, groups) -> List[List[torch.nn.Parameter]]:
    """Parameters reduced together: ``groups`` as a count (split in order) or as lists."""
    if groups is None:
        return []
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        size = -(-len(params) // groups)
        return [params[i:i + size] for i in range(0, len(params), size)]
    out = [list(g) for g in groups]
    known = set(params)
    for g in out:
        for p in g:
            if p not in known:
                raise ValueError("groups lists a tensor that is not a trainable parameter of "
                                 "this optimizer")
    return out


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """``optimizer``, turned into a distributed one (see the module doc); returns it.

    ``op=Average`` divides the summed gradients by the number of contributing ranks
    (ranks that called ``join()`` contribute zeros and are not counted), with
    ``1 / gradient_predivide_factor`` applied before the sum and
    ``gradient_predivide_factor`` after it. ``compression=Compression.fp16`` halves the bytes on the wire.
    ``groups`` (a count, or lists of parameters) reduces parameters together, in one
    fused call per group once the whole group is ready (``num_groups=k``, Horovod's older
    form, is ``groups=k``). Sparse gradients are allgathered
    (or densified with ``sparse_as_dense=True``). With ``process_set``, its members
    average among themselves; on a rank outside it (Horovod scripts wrap the optimizer on
    every rank) the optimizer steps with its own gradients alone.

    ``op=Adasum`` works as Horovod's Adasum optimizer: each rank takes the wrapped
    optimizer's step with its own gradients, then each parameter's change is combined
    across ranks with :data:`ddl.Adasum` and added to the parameter as it was before the
    step (the parameters must start equal on every rank: broadcast them). Do not scale
    the learning rate by ``size()`` with Adasum: it adapts the combination itself. The
    exchange starts in ``step()`` (it does not overlap the backward pass) and each rank
    holds every rank's change of a parameter while it combines them.

    Example::

        opt = torch.optim.SGD(model.parameters(), lr=0.01 * ddl.torch.size())
        opt = ddl.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    """
    if isinstance(optimizer, (_DistributedOptimizer, _DistributedAdasumOptimizer)):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not "
                        f"{type(optimizer).__name__}")
    if num_groups:
        if groups is not None:
            raise ValueError(f"pass groups= or num_groups=, not both (got groups={groups!r}, "
                             f"num_groups={num_groups})")
        groups = num_groups
    base = type(optimizer)
    if ReduceOp(op) == ReduceOp.Adasum:
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor needs op=Average")
        optimizer.__class__ = type(base.__name__, (_DistributedAdasumOptimizer, base),
                                   {"__module__": base.__module__})
        optimizer._ddl_adasum_setup(named_parameters, compression, backward_passes_per_step,
                                    groups, process_set)
        _step_through_the_wrapper(optimizer)
        return optimizer
    optimizer.__class__ = type(base.__name__, (_DistributedOptimizer, base),
                               {"__module__": base.__module__})
    optimizer._ddl_setup(named_parameters, compression, backward_passes_per_step, op,
                         gradient_predivide_factor, groups, sparse_as_dense, process_set)
    _step_through_the_wrapper(optimizer)
    return optimizer


def _step_through_the_wrapper(optimizer) -> None:
    """An LR scheduler made before the optimizer was wrapped replaced ``optimizer.step``
    with its own wrapper around the class's ``step`` of that time, which would bypass the
    distributed ``step()`` (no averaging; the next backward then fails). Wrap the new
    class's ``step`` the same way: marked as torch's, and noting the call as it does."""
    old = optimizer.__dict__.get("step")
    if old is None or not getattr(old, "_wrapped_by_lr_sched", False):
        return
    ref, step = weakref.ref(optimizer), type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        opt = ref()
        opt._opt_called = True   # what torch's wrapper records for the scheduler's check
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper
