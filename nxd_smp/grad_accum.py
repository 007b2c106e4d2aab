"""Gradient accumulation: fp32 ``main_grad`` buffers, the hooks that fill them, and the
flattening of autograd's ``.grad`` when accumulation stays in the parameter dtype.

With fp32 accumulation, each bucket has one flat buffer (``padded_numel`` elements, the
accumulation dtype) and every parameter a view into it. A post-accumulate-grad hook adds
each micro-batch's gradient into the view and frees ``param.grad``, so the
low-precision gradient lives only for the duration of one backward. Nothing here
communicates.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .layout import BucketLayout

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
        contiguous: one flat buffer per bucket with a view per parameter (eager devices:
            the reduce-scatter reads it in place). False: one buffer per parameter,
            concatenated at step time (XLA: adding into slices of one large buffer would
            trace an update of the whole buffer per parameter).

    After ``backward()``, ``flat(b)`` is the sum of every micro-batch's gradient for
    bucket ``b`` (padding zero) and each parameter's ``.grad`` is None.
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
        self.buffers: list[torch.Tensor] = (
            [torch.zeros(layout.padded_numel, dtype=dtype, device=device) for layout in layouts]
            if contiguous
            else []
        )
        self._views: dict[int, torch.Tensor] = {}
        owner = weakref.ref(self)
        for b, layout in enumerate(layouts):
            for i, index in enumerate(layout.param_indices):
                param = params[index]
                if contiguous:
                    start, end = layout.param_range(i)
                    self._views[index] = self.buffers[b][start:end].view(param.shape)
                else:
                    self._views[index] = torch.zeros(param.shape, dtype=dtype, device=device)
                self._attach(param, index, owner)

    def _attach(self, param: torch.Tensor, index: int, owner: "weakref.ref[MainGradBuffers]") -> None:
        def accumulate(p: torch.Tensor) -> None:
            buffers = owner()
            if buffers is None or p.grad is None:
                return  # our optimizer is gone: leave .grad as autograd made it
            buffers._views[index].add_(p.grad)
            p.grad = None

        previous = _ACTIVE_HOOKS.get(param)
        if previous is not None:
            previous.remove()
        handle = param.register_post_accumulate_grad_hook(accumulate)
        _ACTIVE_HOOKS[param] = handle

    def main_grad(self, index: int) -> torch.Tensor:
        """The accumulated gradient of managed parameter ``index``, shaped like it."""
        return self._views[index]

    def flat(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s accumulated gradient as one flat, padded tensor (the buffer
        itself when contiguous, else a new concatenation)."""
        if self.contiguous:
            return self.buffers[b]
        layout = self._layouts[b]
        parts = [self._views[index].reshape(-1) for index in layout.param_indices]
        padding = layout.padded_numel - layout.numel
        if padding:
            parts.append(torch.zeros(padding, dtype=self.dtype, device=self._device))
        return torch.cat(parts)

    def zero_(self) -> None:
        for buffer in self.buffers if self.contiguous else self._views.values():
            buffer.zero_()


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
