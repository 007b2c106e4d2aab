"""The global gradient norm and the clip coefficient, as tensors (no host sync).

``sum_of_squares`` is the local part: fp32, accurate on CPU. ``clip_coefficient`` turns a
norm into the factor ``min(1, max_norm / (norm + 1e-6))`` that torch, NxD and torch_xla
apply. How the local parts are added up over data-, tensor- and pipeline-parallel groups
is the optimizer's business.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sum_of_squares", "clip_coefficient"]

# torch's CPU norm kernel accumulates each thread's share in one fp32 running sum: at
# 20M elements its relative error is ~1e-3. Norms of 256K-element pieces are ~1e-6
# accurate and cost the same single read of the gradient.
_CPU_NORM_PIECE = 1 << 18


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared elements over ``tensors``, accumulated in fp32 (a 0-dim tensor on
    ``device``; zero for an empty list)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    if device.type == "cpu":
        tensors = [piece for t in tensors for piece in t.reshape(-1).split(_CPU_NORM_PIECE)]
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def clip_coefficient(norm: torch.Tensor, grad_clipping: bool, max_norm: float) -> torch.Tensor | None:
    """``min(1, max_norm / (norm + 1e-6))`` as a tensor, or None when nothing is clipped
    (clipping off, or ``max_norm`` infinite)."""
    if not grad_clipping or math.isinf(max_norm):
        return None
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
