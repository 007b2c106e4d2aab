"""Gradient sources: where a step's gradient comes from, and its reduction over the ranks.

Every source hands ``step()`` the same thing (``GradientSource.reduce``): per bucket, this rank's
shard of the gradient summed over micro-batches and data-parallel ranks, NxD's model-parallel sums
included (``Topology.sum_model_parallel_``), in the master dtype; and it starts a new accumulation.
Three sources, one per way the gradient is accumulated (the precision plan says which dtypes):

* ``AutogradGrads`` (``use_fp32_grad_acc=False``): autograd's ``.grad`` in the parameter dtype,
  which the loop clears as with any torch optimizer, flattened per bucket at step time;
* ``MainGradBuffers``: fp32 ``main_grad`` buffers filled by backward hooks, reduce-scattered at
  step time;
* ``ShardedMainGrads`` (``use_sharded_grad_acc``): only this rank's shard of the fp32 sum, each
  bucket reduce-scattered from the hooks as soon as backward has produced it.

A fourth, ``ReplicatedGrads``, serves NxD's trainer wrapper with ZeRO-1 off: there a plain optimizer
steps every parameter on every rank, so this rank's part of each gradient is the whole of it, in
``.grad``, all-reduced in place, in NxD's order, through the same topology (``grad_reduction`` "mean"
or "sum" as the optimizer's); the norm and the clip are the one function every source's step calls
(``Topology.norm_and_coefficient``).

With fp32 accumulation a post-accumulate-grad hook adds each micro-batch's gradient into
the parameter's ``main_grad`` and frees ``param.grad``, so the low-precision gradient lives
only for the duration of one backward (a torch ``clip_grad_norm_`` that then finds no ``.grad``
warns: ``optim.clip_watch``).

The lifecycle is bookkeeping, not memsets: after ``start_new_accumulation()`` (called by
the optimizer's ``step()`` and ``zero_grad()``) the first gradient of a parameter is
*copied* into its ``main_grad``, later ones are added; ``flat(b)`` zeroes only the
parameters that got no gradient since. So no training loop has to clear anything, and a
loop that calls ``model.zero_grad()``, ``optimizer.zero_grad()`` or nothing trains the same.
A ``.grad`` the hooks did not see (set by hand, or computed before the optimizer existed) is taken
into the step's sum.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .core.errors import ConfigError
from .backend.base import PendingShard
from .core.dtensors import local_grad, local_shape
from .core.flatten import flatten_bucket
from .core.layout import BucketLayout
from .core.memory import staggered_empty
from .optim.clip_watch import ClipWatch
from .optim.norm import NORM_ROLES, norm_role
from .optim.param_groups import sequence_parallel_marked
from .optim.precision import PrecisionPlan
from .optim.topology import Topology

__all__ = ["GradientSource", "AutogradGrads", "MainGradBuffers", "ShardedMainGrads", "ReplicatedGrads"]

# The hook currently registered on each parameter. A parameter is accumulated by one
# MainGradBuffers at a time: building a new one for the same parameter (a new optimizer
# over the same model) detaches the previous one's hook, so gradients are never split
# between two buffers.
_ACTIVE_HOOKS = WeakIdKeyDictionary()


class GradientSource(ABC):
    """Where one optimizer's gradient comes from, and its reduction.

    Args:
        params: all managed parameters, in layout order; ``layouts`` index into this list.
        layouts: one per bucket.
        topology: the groups: the data-parallel reduce-scatter, the model-parallel sums.
        plan: the dtypes: the wire dtype of each bucket's reduce-scatter, its master dtype.
    """

    def __init__(self, params: Sequence[torch.Tensor], layouts: Sequence[BucketLayout], topology: Topology,
                 plan: PrecisionPlan):
        self._params = list(params)
        self._layouts = list(layouts)
        self._topology = topology
        self._backend = topology.data
        dtypes = [params[layout.param_indices[0]].dtype for layout in layouts]
        self._wire = [plan.wire(d) for d in dtypes]
        self._masters = [plan.master(d) for d in dtypes]
        self._marked = [bool(getattr(layout.key, "sequence_parallel", False)) for layout in layouts]

    @abstractmethod
    def reduce(self) -> list[torch.Tensor]:
        """This rank's part of the step's gradient, summed over the micro-batches since the last step and
        over the data-parallel ranks (NxD's model-parallel sums done): per bucket this rank's shard, in
        the master dtype (the sharded sources), or per parameter with a ``.grad`` the whole of it
        (``ReplicatedGrads``); the accumulation is consumed: the next backward starts a new one."""

    def start_new_accumulation(self) -> None:
        """Forget the accumulation in progress."""

    def holds_accumulation(self) -> bool:
        """Whether a gradient was accumulated since the accumulation started (host bookkeeping; the
        sources whose hooks take ``.grad`` away say, for ``optim.clip_watch``)."""
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the accumulation in progress and the parameters' ``.grad``."""
        self.start_new_accumulation()
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def main_grad(self, index: int | None) -> torch.Tensor:
        """The fp32 gradient of managed parameter ``index`` accumulated so far (None: a parameter
        the optimizer does not manage)."""
        raise RuntimeError("main_grad exists only with use_fp32_grad_acc=True.")

    def _take_stray_grads(self) -> None:
        """A ``.grad`` the hooks did not see (set by hand, or computed before the optimizer
        existed) joins the accumulation."""
        for i, p in enumerate(self._params):
            if p.grad is not None:
                self.add(i, local_grad(p, p.grad))
                p.grad = None

    def add(self, index: int, grad: torch.Tensor, in_backward: bool = False) -> None:
        """Accumulate ``grad`` for managed parameter ``index`` (the sources with hooks: autograd's
        ``.grad`` accumulates by itself)."""
        raise NotImplementedError(f"{type(self).__name__} takes no gradient by hand; autograd fills .grad.")

    def _reduce_flat(self, flats: list[torch.Tensor], spares: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each bucket's whole gradient ``flats`` (overwritten), in its wire dtype, summed over the
        model-parallel groups, then reduce-scattered (into ``spares`` where given)."""
        flats = [flat if flat.dtype == wire else flat.to(wire) for flat, wire in zip(flats, self._wire)]
        self._topology.sum_model_parallel_(flats, self._marked)
        return self._backend.reduce_scatter(flats, into=list(spares))

    def _in_master_dtype(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [s if s.dtype == dtype else s.to(dtype) for s, dtype in zip(shards, self._masters)]


class AutogradGrads(GradientSource):
    """Autograd's ``.grad`` in the parameter dtype (``use_fp32_grad_acc=False``): the loop clears it
    as with any torch optimizer; at step time each bucket's is flattened into a new buffer of its
    wire dtype (a parameter without a gradient, and the padding, zero)."""

    def reduce(self) -> list[torch.Tensor]:
        device = self._backend.device
        flats = [flatten_bucket(layout, [None if (p := self._params[i]).grad is None else local_grad(p, p.grad)
                                        for i in layout.param_indices], wire, device)
                 for layout, wire in zip(self._layouts, self._wire)]
        return self._in_master_dtype(self._reduce_flat(flats, [None] * len(flats)))


class MainGradBuffers(GradientSource):
    """Gradient-accumulation buffers for a list of buckets.

    Args:
        params, layouts, topology, plan: as ``GradientSource``; the buffers hold the plan's
            accumulation dtype (fp32 on the device) on the data-parallel backend's device.
        contiguous: one persistent flat buffer per bucket with a view per parameter (eager
            devices: the reduce-scatter reads it in place). False (XLA): no persistent
            buffer; each parameter's accumulation is a tensor of this step's graph and the
            bucket is one concatenation at step time (adding into slices of one large
            buffer would trace an update of the whole buffer per parameter). None: the
            backend's choice (``persistent_grad_buffers``).

    After ``backward()``, ``flat(b)`` is the sum of the gradients since the last
    ``start_new_accumulation()`` for bucket ``b`` (zero for parameters without one, and
    for the padding), and each parameter's ``.grad`` is None.
    """

    def __init__(self, params: Sequence[torch.Tensor], layouts: Sequence[BucketLayout], topology: Topology,
                 plan: PrecisionPlan, contiguous: bool | None = None):
        super().__init__(params, layouts, topology, plan)
        dtype, device = plan.fp32, topology.data.device
        contiguous = topology.data.persistent_grad_buffers if contiguous is None else contiguous
        self.dtype = dtype
        self.contiguous = contiguous
        self._device = device
        self._numel = len(params)
        self._shapes = [local_shape(p) for p in params]
        self.buffers: list[torch.Tensor] = (
            [staggered_empty(layout.padded_numel, dtype, device, "grad").zero_() for layout in layouts]
            if contiguous
            else []
        )
        # contiguous: a view per parameter into its bucket's buffer; else this step's sum
        # (None until the parameter's first gradient).
        self._acc: list[torch.Tensor | None] = [None] * len(params)
        self._fresh = [True] * len(params)  # no gradient since the accumulation started
        owner = weakref.ref(self)
        for b, layout in enumerate(layouts):
            for i, index in enumerate(layout.param_indices):
                if contiguous:
                    start, end = layout.param_range(i)
                    self._acc[index] = self.buffers[b][start:end].view(self._shapes[index])
                _attach_hook(params[index], index, owner)
        self.clip_watch = _clip_watch(params, owner)

    def holds_accumulation(self) -> bool:
        return not all(self._fresh)

    @torch.no_grad()
    def add(self, index: int, grad: torch.Tensor, in_backward: bool = False) -> None:
        """Accumulate ``grad`` for managed parameter ``index``: copied if it is the first
        gradient since the accumulation started, else added. (``in_backward``, which the
        hooks pass to either kind of buffers, matters only to ``ShardedMainGrads``.)"""
        if not self._fresh[index]:
            self._acc[index].add_(grad)
        elif self.contiguous:
            self._acc[index].copy_(grad)
        else:
            self._acc[index] = grad.to(self.dtype)  # a new tensor unless already fp32 (then ours now)
        self._fresh[index] = False

    def start_new_accumulation(self) -> None:
        """Forget the accumulation: the next gradient of each parameter is copied, and a
        parameter that gets none counts zero. No memory is touched."""
        self._fresh = [True] * self._numel
        if not self.contiguous:
            self._acc = [None] * self._numel

    def main_grad(self, index: int | None) -> torch.Tensor:
        """The accumulated gradient of managed parameter ``index``, shaped like it (zeros if
        it got none since the accumulation started).

        Raises:
            ValueError: ``index`` is None (the parameter asked for is not managed).
        """
        if index is None:
            raise ConfigError("this parameter is not managed by the optimizer; pass one it was built with.")
        if self._fresh[index]:
            if self.contiguous:
                self._acc[index].zero_()
            else:
                self._acc[index] = torch.zeros(self._shapes[index], dtype=self.dtype, device=self._device)
            self._fresh[index] = False  # now it holds the (zero) sum; later gradients add
        return self._acc[index]

    @torch.no_grad()
    def flat(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s accumulated gradient as one flat, padded tensor: the buffer itself
        when contiguous (its untouched parameters and padding zeroed now), else one
        concatenation."""
        layout = self._layouts[b]
        if self.contiguous:
            for index in layout.param_indices:
                if self._fresh[index]:
                    self._acc[index].zero_()
            self.buffers[b][layout.numel :].zero_()  # padding: a step may have scaled it
            return self.buffers[b]
        parts = [None if self._fresh[index] else self._acc[index] for index in layout.param_indices]
        return flatten_bucket(layout, parts, self.dtype, self._device)


    def reduce(self) -> list[torch.Tensor]:
        self._take_stray_grads()
        # a shard that arrives in another dtype may land in the consumed accumulation itself
        spares = [buffer if buffer.dtype == master else None for buffer, master in zip(self.buffers, self._masters)]
        shards = self._reduce_flat([self.flat(b) for b in range(len(self._layouts))], spares or [None] * len(self._layouts))
        self.start_new_accumulation()
        return self._in_master_dtype(shards)


def _clip_watch(params: Sequence[torch.Tensor], owner: weakref.ref) -> ClipWatch:
    """A torch ``clip_grad_norm_`` that finds no ``.grad`` on ``params`` while ``owner()`` holds their
    gradients warns (``optim.clip_watch``)."""
    return ClipWatch(params, lambda: (source := owner()) is not None and source.holds_accumulation())


def _attach_hook(param: torch.Tensor, index: int, owner: weakref.ref) -> None:
    """After each backward, ``owner().add(index, param.grad)`` and ``param.grad = None``."""

    def accumulate(p: torch.Tensor) -> None:
        buffers = owner()
        if buffers is None or p.grad is None:
            return  # our optimizer is gone: leave .grad as autograd made it
        buffers.add(index, local_grad(p, p.grad), in_backward=True)
        p.grad = None

    previous = _ACTIVE_HOOKS.get(param)
    if previous is not None:
        previous.remove()
    handle = param.register_post_accumulate_grad_hook(accumulate)
    _ACTIVE_HOOKS[param] = handle


class ShardedMainGrads(GradientSource):
    """This rank's shard of the fp32 gradient sum, filled bucket by bucket during backward.

    Args:
        params, layouts, topology, plan: as ``GradientSource``: the reduce-scatters
            (``reduce_scatter_start``) run over the data-parallel backend, where the shards live,
            each bucket in its wire dtype; the sums are the plan's fp32 (float64 under
            ``XLA_DOWNCAST_BF16``).
        in_flight: how many buckets' reduce-scatters may be under way at once (each holds
            one bucket of staging); more overlap, more memory.

    One backward pass is the gradients between its first hook and its end (an autograd
    final callback). A bucket whose parameters have all delivered their gradient is
    launched; launches go in one fixed order, the buckets from last to first (backward
    reaches the last parameters first), so every rank issues the same collectives in the
    same order whatever its data. At the end of the pass the rest are launched, a parameter
    without a gradient counting zero (every rank reduce-scatters every bucket once per
    backward), and every shard is added into the fp32 sum: copied if it is the first since
    the accumulation started, else added. Sums are fp32 over micro-batches, and over ranks
    in the wire dtype (fp32 unless ``reduce_dtype`` lowers it).
    """

    def __init__(self, params: Sequence[torch.Tensor], layouts: Sequence[BucketLayout], topology: Topology,
                 plan: PrecisionPlan, in_flight: int = 2):
        super().__init__(params, layouts, topology, plan)
        backend = topology.data
        self.dtype = plan.fp32
        self._in_flight_max = max(1, int(in_flight))
        self._bucket_of = {}
        for b, layout in enumerate(layouts):
            for index in layout.param_indices:
                self._bucket_of[index] = b
        self._persistent = backend.persistent_grad_buffers
        # The sum per bucket shard: persistent buffers on eager devices, this step's tensors
        # on XLA. ``_fresh[b]``: nothing added since the accumulation started.
        self._sums: list[torch.Tensor | None] = [
            staggered_empty(layout.shard_numel, self.dtype, backend.device, "grad").zero_() if self._persistent else None
            for layout in layouts
        ]
        self._fresh = [True] * len(layouts)
        self._order = list(reversed(range(len(layouts))))
        self._pools: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._new_pass()
        owner = weakref.ref(self)
        for layout in layouts:
            for index in layout.param_indices:
                _attach_hook(params[index], index, owner)
        self.clip_watch = _clip_watch(params, owner)

    def holds_accumulation(self) -> bool:
        return self._in_pass or not all(self._fresh)

    def _borrow(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``numel``-element buffer of ``dtype`` from the pool of ``kind`` ("staging": flat
        buckets, "shard": reduce-scatter results); at most ``in_flight`` of each are ever
        allocated, so no backward allocates (and faults in) fresh memory."""
        pool = self._pools.setdefault((kind, dtype), [])
        if pool:
            return pool.pop()[:numel]
        size = max(layout.padded_numel if kind == "staging" else layout.shard_numel for layout in self._layouts)
        return torch.empty(size, dtype=dtype, device=self._backend.device)[:numel]

    def _give_back(self, kind: str, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._pools[(kind, buffer.dtype)].append(buffer._base if buffer._base is not None else buffer)

    def _new_pass(self) -> None:
        self._in_pass = False
        self._grads: list[dict[int, torch.Tensor]] = [{} for _ in self._layouts]
        self._next = 0  # position in ``_order`` of the next bucket to launch
        # (bucket, the reduce-scatter, its staging and its result buffer from the pools, or None)
        self._pending: deque[tuple[int, PendingShard, torch.Tensor | None, torch.Tensor | None]] = deque()

    # ---------------------------------------------------------------- during backward
    @torch.no_grad()
    def add(self, index: int, grad: torch.Tensor, in_backward: bool = False) -> None:
        """This pass's gradient of managed parameter ``index``. From a hook
        (``in_backward``), the pass ends with the backward; otherwise ``end_pass()`` ends it."""
        if not self._in_pass:
            self._in_pass = True
            if in_backward:
                torch.autograd.Variable._execution_engine.queue_callback(self.end_pass)
        b = self._bucket_of[index]
        mine = self._grads[b]
        mine[index] = mine[index] + grad if index in mine else grad  # (twice in one pass: reentrant backward)
        if len(mine) == len(self._layouts[b].param_indices):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._order):
            b = self._order[self._next]
            if len(self._grads[b]) != len(self._layouts[b].param_indices):
                return  # launches keep their order: a later bucket waits for this one
            self._launch(b)

    def _launch(self, b: int) -> None:
        while len(self._pending) >= self._in_flight_max:
            self._finish_one()  # its staging goes before this bucket's comes
        flat = self._flatten(b)
        self._grads[b] = {}
        self._next += 1
        result = None
        if self._persistent:  # a fresh fp32 sum takes the result itself: no copy
            into_sum = self._fresh[b] and flat.dtype == self.dtype
            result = None if into_sum else self._borrow("shard", self._layouts[b].shard_numel, flat.dtype)
            pending = self._backend.reduce_scatter_start(flat, self._sums[b] if into_sum else result)
        else:
            pending = self._backend.reduce_scatter_start(flat)
        self._pending.append((b, pending, flat if self._persistent else None, result))

    def _flatten(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s gradient of this pass, flat and padded, in its wire dtype."""
        layout, grads, dtype = self._layouts[b], self._grads[b], self._wire[b]
        staging = self._borrow("staging", layout.padded_numel, dtype) if self._persistent else None
        return flatten_bucket(layout, [grads.get(index) for index in layout.param_indices], dtype,
                              self._backend.device, into=staging)

    def _finish_one(self) -> None:
        b, pending, staging, result = self._pending.popleft()
        shard = pending.wait()
        total = self._sums[b]
        if self._persistent:
            if shard is not total:  # (else the reduce-scatter wrote the sum itself)
                if self._fresh[b]:
                    total.copy_(shard)
                else:
                    total.add_(shard)
            self._give_back("staging", staging)
            self._give_back("shard", result)
        else:
            shard = shard.to(self.dtype)
            self._sums[b] = shard if self._fresh[b] else total + shard
        self._fresh[b] = False

    @torch.no_grad()
    def end_pass(self) -> None:
        """Launch every bucket not launched in this pass (in the fixed order) and add every
        shard into the sums. Runs at the end of each backward."""
        if not self._in_pass:
            return
        while self._next < len(self._order):
            self._launch(self._order[self._next])
        while self._pending:
            self._finish_one()
        self._new_pass()

    # ---------------------------------------------------------------- at step time
    def start_new_accumulation(self) -> None:
        """Forget the accumulation: the next shard of each bucket is copied, and a bucket
        without one counts zero. No memory is touched."""
        self._fresh = [True] * len(self._layouts)
        if not self._persistent:
            self._sums = [None] * len(self._layouts)

    def main_grad(self, index: int) -> torch.Tensor:
        raise RuntimeError(
            "main_grad is not kept with use_sharded_grad_acc=True: each rank holds only its "
            "shard of the gradient, summed over ranks, and no rank has a parameter's whole "
            "gradient. Turn use_sharded_grad_acc off to read it."
        )

    def reduce(self) -> list[torch.Tensor]:
        # (A .grad set by hand is reduced here as one more pass; every rank must then have one,
        # as every rank runs each backward.)
        self._take_stray_grads()
        self.end_pass()
        shards = [self.shard(b) for b in range(len(self._layouts))]
        self._topology.sum_model_parallel_(shards, self._marked)  # (sums commute with the DP reduction)
        self.start_new_accumulation()
        return self._in_master_dtype(shards)

    def shard(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s accumulated gradient shard, fp32 (zeros if it got none)."""
        if self._fresh[b]:
            if self._persistent:
                self._sums[b].zero_()
            else:
                self._sums[b] = torch.zeros(self._layouts[b].shard_numel, dtype=self.dtype, device=self._backend.device)
            self._fresh[b] = False
        return self._sums[b]


class ReplicatedGrads(GradientSource):
    """The gradient of a plain (unsharded) optimizer under NxD's trainer wrapper with ZeRO-1 off: every
    rank holds the whole gradient in ``.grad``, reduced in place. Its part of each gradient is the whole
    of it (``reduce``), every parameter's ``.grad``, which autograd accumulates and the loop clears.

    Args:
        param_groups: returns the optimizer's param groups (asked at each step: a load or an added
            group may replace them; the parameters with a ``.grad`` then are reduced).
        topology: the groups.
        plan: the dtypes (the norm's).
        grad_reduction: ``"mean"`` (NxD's: each gradient divided by the data-parallel size, and over
            context parallelism by its size, before it is summed) or ``"sum"`` (summed: a loss that is
            each rank's sum over its tokens divided by the global token count).
    """

    def __init__(self, param_groups: Callable[[], Sequence[dict]], topology: Topology, plan: PrecisionPlan,
                 grad_reduction: str = "mean"):
        super().__init__([], [], topology, plan)
        if grad_reduction not in ("mean", "sum"):
            raise ConfigError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}.")
        self.grad_reduction = grad_reduction
        self._groups = param_groups
        self._reduced: list[torch.Tensor] = []

    def _with_grad(self) -> list[torch.Tensor]:
        return [p for group in self._groups() for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def reduce(self) -> list[torch.Tensor]:
        """Every ``.grad`` reduced in place in NxD's order, and returned (the parameters' order): the
        context-parallel mean, the sum over tensor parallelism of the parameters marked
        ``sequence_parallel_enabled``, the data-parallel mean (bucketed, last parameters first); with
        ``"sum"`` the context- and data-parallel sums instead. The norm's roles: ``norm_roles``."""
        with_grad = self._with_grad()
        grads = [p.grad for p in with_grad]
        mean = self.grad_reduction == "mean"
        self._topology.sum_model_parallel_(grads, [sequence_parallel_marked(p) for p in with_grad],
                                           per_parameter=True, mean=mean)
        data = self._topology.data
        if data.world_size > 1:
            if mean:
                torch._foreach_div_(grads, float(data.world_size))
            data.all_reduce_many_(grads[::-1])
        self._reduced = with_grad
        return grads

    def norm_roles(self) -> dict[str, list[torch.Tensor]]:
        """The gradients the last ``reduce`` returned, by norm role (``optim.norm.norm_role``)."""
        pipeline = bool(self._topology.pipeline)
        by_role: dict[str, list[torch.Tensor]] = {role: [] for role in NORM_ROLES}
        for p in self._reduced:
            by_role[norm_role(p, pipeline_parallel=pipeline)].append(p.grad)
        return by_role
