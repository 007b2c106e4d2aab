"""Gradient accumulation: fp32 ``main_grad`` buffers, the hooks that fill them, and the
flattening of autograd's ``.grad`` when accumulation stays in the parameter dtype.

With fp32 accumulation a post-accumulate-grad hook adds each micro-batch's gradient into
the parameter's ``main_grad`` and frees ``param.grad``, so the low-precision gradient lives
only for the duration of one backward.

The lifecycle is bookkeeping, not memsets: after ``start_new_accumulation()`` (called by
the optimizer's ``step()`` and ``zero_grad()``) the first gradient of a parameter is
*copied* into its ``main_grad``, later ones are added; ``flat(b)`` zeroes only the
parameters that got no gradient since. So no training loop has to clear anything, and a
loop that calls ``model.zero_grad()``, ``optimizer.zero_grad()`` or nothing trains the same.
Nothing here communicates.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .layout import BucketLayout
from .placement import staggered_empty

__all__ = ["MainGradBuffers", "flatten_grads"]

# The hook currently registered on each parameter. A parameter is accumulated by one
# MainGradBuffers at a time: building a new one for the same parameter (a new optimizer
# over the same model) detaches the previous one's hook, so gradients are never split
# between two buffers.
_ACTIVE_HOOKS = WeakIdKeyDictionary()


class MainGradBuffers:
    """Gradient-accumulation buffers for a list of buckets.

    Args:
        params: all managed parameters; ``layouts`` index into this list.
        layouts: one per bucket.
        dtype: accumulation dtype (fp32 under SMP).
        device: where the buffers live (the parameters' device).
        contiguous: one persistent flat buffer per bucket with a view per parameter (eager
            devices: the reduce-scatter reads it in place). False (XLA): no persistent
            buffer; each parameter's accumulation is a tensor of this step's graph and the
            bucket is one concatenation at step time (adding into slices of one large
            buffer would trace an update of the whole buffer per parameter).

    After ``backward()``, ``flat(b)`` is the sum of the gradients since the last
    ``start_new_accumulation()`` for bucket ``b`` (zero for parameters without one, and
    for the padding), and each parameter's ``.grad`` is None.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layouts: Sequence[BucketLayout],
        dtype: torch.dtype,
        device: torch.device,
        contiguous: bool = True,
    ):
        self.dtype = dtype
        self.contiguous = contiguous
        self._layouts = list(layouts)
        self._device = device
        self._numel = len(params)
        self._shapes = [p.shape for p in params]
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
                    self._acc[index] = self.buffers[b][start:end].view(params[index].shape)
                self._attach(params[index], index, owner)

    def _attach(self, param: torch.Tensor, index: int, owner: "weakref.ref[MainGradBuffers]") -> None:
        def accumulate(p: torch.Tensor) -> None:
            buffers = owner()
            if buffers is None or p.grad is None:
                return  # our optimizer is gone: leave .grad as autograd made it
            buffers.add(index, p.grad)
            p.grad = None

        previous = _ACTIVE_HOOKS.get(param)
        if previous is not None:
            previous.remove()
        handle = param.register_post_accumulate_grad_hook(accumulate)
        _ACTIVE_HOOKS[param] = handle

    @torch.no_grad()
    def add(self, index: int, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` for managed parameter ``index``: copied if it is the first
        gradient since the accumulation started, else added."""
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

    def main_grad(self, index: int) -> torch.Tensor:
        """The accumulated gradient of managed parameter ``index``, shaped like it (zeros if
        it got none since the accumulation started)."""
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
        parts = [
            torch.zeros(self._shapes[index].numel(), dtype=self.dtype, device=self._device)
            if self._fresh[index]
            else self._acc[index].reshape(-1)
            for index in layout.param_indices
        ]
        padding = layout.padded_numel - layout.numel
        if padding:
            parts.append(torch.zeros(padding, dtype=self.dtype, device=self._device))
        return torch.cat(parts)


def flatten_grads(
    params: Sequence[torch.Tensor], layout: BucketLayout, dtype: torch.dtype
) -> torch.Tensor:
    """A new flat buffer (``layout.padded_numel`` elements of ``dtype``) holding the
    ``.grad`` of the bucket's parameters; a parameter without a gradient and the padding
    are zero."""
    first = params[layout.param_indices[0]]
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=first.device)
    for i, index in enumerate(layout.param_indices):
        grad = params[index].grad
        if grad is not None:
            start, end = layout.param_range(i)
            flat[start:end].copy_(grad.reshape(-1))
    return flat
