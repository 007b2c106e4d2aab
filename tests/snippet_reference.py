"""The unsharded reference the documentation's snippets are checked against: standard mixed
precision written out plainly (bf16 backward per micro-batch, fp32 sums, the global norm,
clipping, a stock ``torch.optim.AdamW`` step on fp32 copies, the cast back)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn


def smp_reference(
    initial: nn.Module,
    steps: Sequence[Sequence[torch.Tensor]],
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    *,
    lr: float,
    max_norm: float,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train a copy of the bf16 ``initial`` model on ``steps`` (each a list of micro-batches);
    return its final parameters by name and the pre-clip norm of every step."""
    model = copy.deepcopy(initial)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(masters, lr=lr)
    norms = []
    for micro_batches in steps:
        sums = [torch.zeros_like(m) for m in masters]
        for x in micro_batches:
            model.zero_grad(set_to_none=True)
            loss(model, x).backward()
            for s, p in zip(sums, params):
                s += p.grad.float()
        norm = math.sqrt(sum(float(s.pow(2).sum()) for s in sums))
        coef = min(1.0, max_norm / (norm + 1e-6))
        for m, s in zip(masters, sums):
            m.grad = s * coef
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m.to(p.dtype))
        norms.append(norm)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms
