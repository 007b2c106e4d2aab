"""Parameters frozen at step time, as torch.optim treats them, and parameters unfrozen after the build.

torch.optim steps only parameters with a gradient, and a parameter with ``requires_grad=False`` gets
none: it is not touched at all (no weight decay, no change of its moments), and torch's
``clip_grad_norm_`` leaves it out of the norm. The optimizer here steps one flat shard per bucket,
so at each step it decides on the host which managed parameters are frozen (``requires_grad``
False now: a Python loop over them, no device sync) and ``FrozenElements`` then

* zeroes their gradient in the reduced shards, before the global norm;
* keeps their elements of this rank's shards before the inner step (the master, every shard-shaped
  state tensor of the inner optimizer, and on the compiled CPU path, which writes the parameters
  itself, the parameter shard and its remainder) and puts them back before the shards are
  published, whatever kernel ran. A state tensor the step created (a first step) gets zeros there,
  the value of a fresh state.

Their step counters (Adam's ``step``) stand still as torch's per-parameter ones do: that is
``step_counters``' job, beside this one.

On eager devices the frozen elements are cut from this rank's shard with host slices. On XLA a
mask over the bucket, cut by the backend with the rank as data, selects them: the step's program
changes only when the frozen set changes, and it is the same program on every rank as long as every
rank freezes alike. Each rank decides from its own parameters, so freeze and unfreeze on every rank
(as with DDP): a parameter frozen on one rank only would be kept there and updated elsewhere.

Parameters frozen when the optimizer was built are not managed (no masters, no fp32 buffers, which
is what LoRA's memory rests on). One unfrozen afterwards cannot be trained, and silently ignoring it
would be wrong: ``FrozenParams.now`` refuses the step.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence

import torch

from ..backend import Backend
from ..core.flatten import flatten_bucket
from ..core.layout import BucketLayout

_REQUIRES_GRAD = operator.attrgetter("requires_grad")

#: Named tensors of this rank's shard of one bucket, whose frozen elements a step keeps.
Targets = Callable[[int], dict[str, torch.Tensor]]


def bucket_mask(layout: BucketLayout, members: Sequence[bool], device: torch.device) -> torch.Tensor:
    """A bool per element of the bucket (padding included, False): whether it belongs to a member
    parameter (``members``: one flag per parameter of the bucket, in order)."""
    parts = [torch.ones(n, dtype=torch.bool, device=device) if m else None for n, m in zip(layout.numels, members)]
    return flatten_bucket(layout, parts, torch.bool, device)


def _frozen_ranges(layout: BucketLayout, members: Sequence[bool], rank: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``rank``'s shard that member parameters occupy, adjacent ones joined."""
    ranges: list[tuple[int, int]] = []
    for piece in layout.pieces(rank):
        if members[piece.index]:
            start, end = piece.shard_start, piece.shard_start + piece.numel
            if ranges and ranges[-1][1] == start:
                start = ranges.pop()[0]
            ranges.append((start, end))
    return ranges


class FrozenElements:
    """The elements of this rank's shards that belong to the parameters ``frozen`` (indices into the
    managed parameters that ``layouts`` index)."""

    def __init__(self, layouts: Sequence[BucketLayout], frozen: Sequence[int], backend: Backend):
        wanted = set(frozen)
        self.frozen = tuple(sorted(wanted))
        self._layouts = list(layouts)
        self._backend = backend
        self._members = {b: members for b, layout in enumerate(layouts)
                         if any(members := [i in wanted for i in layout.param_indices])}
        # eager: host slices of this rank's shard (a bucket whose frozen part lies on other ranks drops out)
        self._ranges = None
        if backend.host_rank_slices:
            self._ranges = {b: r for b, members in self._members.items()
                            if (r := _frozen_ranges(layouts[b], members, backend.rank))}

    @property
    def buckets(self) -> list[int]:
        """The buckets with frozen elements in this rank's shard (on XLA: in the bucket)."""
        return sorted(self._members if self._ranges is None else self._ranges)

    def _mask(self, b: int) -> torch.Tensor:
        # Built in the step's graph from constants and the rank as data: no host sync, one program.
        return self._backend.local_shard(bucket_mask(self._layouts[b], self._members[b], self._backend.device))

    def zero_(self, shards: Sequence[torch.Tensor]) -> None:
        """Zero the frozen elements of ``shards`` (this rank's shard of each bucket: the gradients)."""
        for b in self.buckets:
            if self._ranges is None:
                shards[b].masked_fill_(self._mask(b), 0)
            else:
                for start, end in self._ranges[b]:
                    shards[b][start:end].zero_()

    def keep(self, targets: Targets) -> Callable[[], None]:
        """Keep the frozen elements of the shard-shaped tensors ``targets(b)`` names for each bucket;
        returns the call that puts them back into the tensors ``targets(b)`` names then (a tensor
        that was not there before, a state the step created, gets zeros)."""
        saved: dict[int, dict[str, torch.Tensor | list[torch.Tensor]]] = {}
        masks = {} if self._ranges is not None else {b: self._mask(b) for b in self.buckets}
        with torch.no_grad():
            for b in self.buckets:
                named = self._shard_shaped(b, targets(b))
                if self._ranges is None:
                    saved[b] = {name: t.clone() for name, t in named.items()}
                else:
                    saved[b] = {name: [t[start:end].clone() for start, end in self._ranges[b]]
                                for name, t in named.items()}

        @torch.no_grad()
        def restore() -> None:
            for b in self.buckets:
                for name, t in self._shard_shaped(b, targets(b)).items():
                    old = saved[b].get(name)
                    if self._ranges is None:
                        t.copy_(torch.where(masks[b], 0 if old is None else old, t))
                    else:
                        for i, (start, end) in enumerate(self._ranges[b]):
                            if old is None:
                                t[start:end].zero_()
                            else:
                                t[start:end].copy_(old[i])

        return restore

    def _shard_shaped(self, b: int, named: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        numel = self._layouts[b].shard_numel
        return {name: t for name, t in named.items()
                if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == numel}


class FrozenParams:
    """At each step, the managed parameters frozen now, and the refusal of unmanaged ones unfrozen.

    Args:
        managed: the managed parameters, in layout order.
        unmanaged: the parameters of the caller's param groups that were frozen at the build (kept
            weakly: a parameter the model drops is forgotten).
    """

    def __init__(self, managed: Sequence[torch.Tensor], unmanaged: Sequence[torch.Tensor]):
        self._managed = list(managed)
        self._unmanaged = [weakref.ref(p) for p in unmanaged]
        self._last: FrozenElements | None = None

    def now(self, layouts: Sequence[BucketLayout], backend: Backend) -> FrozenElements | None:
        """The frozen elements of this step in the buckets ``layouts`` on ``backend`` (None: no
        managed parameter is frozen), read on the host.

        Raises:
            RuntimeError: a parameter frozen at the build requires a gradient now.
        """
        for ref in self._unmanaged:
            p = ref()
            if p is not None and p.requires_grad:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} had requires_grad=False when this optimizer was built, "
                    f"so it has no master weights or optimizer state, and it requires a gradient now: the "
                    f"optimizer cannot train it. Build the optimizer after unfreezing it (or pass every parameter "
                    f"that will train with requires_grad=True at the build, and freeze it afterwards)."
                )
        if all(map(_REQUIRES_GRAD, self._managed)):
            return None  # (the common case: one attribute read per parameter)
        frozen = tuple(i for i, p in enumerate(self._managed) if not p.requires_grad)
        if self._last is None or self._last.frozen != frozen:
            self._last = FrozenElements(layouts, frozen, backend)
        return self._last
