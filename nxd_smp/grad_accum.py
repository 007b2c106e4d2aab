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
    """Flat gradient-accumulation buffers for a list of buckets.

    Args:
        params: all managed parameters; ``layouts`` index into this list.
        layouts: one per bucket.
        dtype: accumulation dtype (fp32 under SMP).
        device: where the buffers live (the parameters' device).

    After ``backward()``, ``buffers[b]`` holds the sum of every micro-batch's gradient for
    bucket ``b`` (padding stays zero) and each parameter's ``.grad`` is None.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layouts: Sequence[BucketLayout],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.dtype = dtype
        self.buffers: list[torch.Tensor] = [
            torch.zeros(layout.padded_numel, dtype=dtype, device=device) for layout in layouts
        ]
        self._views: dict[int, torch.Tensor] = {}
        self._handles = []
        owner = weakref.ref(self)
        for layout, buffer in zip(layouts, self.buffers):
            for i, index in enumerate(layout.param_indices):
                param = params[index]
                start, end = layout.param_range(i)
                self._views[index] = buffer[start:end].view(param.shape)
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
        self._handles.append(handle)

    def main_grad(self, index: int) -> torch.Tensor:
        """The accumulated gradient of managed parameter ``index``, shaped like it."""
        return self._views[index]

    def zero_(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()

    def remove_hooks(self) -> None:
        """Stop accumulating: later backward passes leave gradients in ``.grad``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


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
