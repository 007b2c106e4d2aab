"""``grad_reduction``: how the data-parallel ranks' gradients combine.

TorchTitan's loss (and Megatron's ``calculate_per_token_loss``) is each rank's sum over its tokens
divided by the global token count: the gradient of the global mean is the *sum* of the ranks'
gradients. The oracle is one process over the whole batch with the same loss, torch's own
``clip_grad_norm_`` and ``AdamW``: with ``grad_reduction="sum"`` the norm nxd_smp measures and the
weights after a clipped step match it at DP 2; the default ``"mean"`` is half the gradient there
(the calibration: the same comparison fails).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nxd_smp import ConfigError, Zero1Optimizer
from tests.distributed import run_ranks

TOKENS, DIM = 8, 6  # per rank


def model_of() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 3))


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, 3, generator=g)


def per_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, global_tokens: int) -> torch.Tensor:
    return (model(x) - y).pow(2).sum() / global_tokens


def reference(world: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The whole batch in one process: the global-mean loss, torch's clip at 0.5 and AdamW."""
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for rank in range(world):
        per_token_loss(model, *data(rank), TOKENS * world).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
    opt.step()
    return norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def dp_step(rank: int, world: int, reduction: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = model_of()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=0.5, grad_reduction=reduction,
                         compile_update=False)
    per_token_loss(model, *data(rank), TOKENS * world).backward()
    opt.step()
    return float(opt.grad_norm), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sum_matches_the_global_per_token_loss_at_dp2_and_mean_does_not():
    norm, weights = reference(2)
    for rank_norm, rank_weights in run_ranks(2, dp_step, "sum"):
        assert rank_norm == pytest.approx(norm, rel=1e-5)
        for name, value in weights.items():
            assert torch.allclose(rank_weights[name], value, rtol=1e-5, atol=1e-6), name
    mean_norm, _ = run_ranks(2, dp_step, "mean")[0]
    assert mean_norm == pytest.approx(norm / 2, rel=1e-5)  # the calibration: averaging halves the gradient


def test_at_dp1_sum_and_mean_are_the_same():
    (norm_sum, weights_sum), (norm_mean, weights_mean) = dp_step(0, 1, "sum"), dp_step(0, 1, "mean")
    assert norm_sum == norm_mean and all(torch.equal(weights_sum[n], weights_mean[n]) for n in weights_sum)


@pytest.mark.parametrize("value", ["avg", None, 2])
def test_an_unknown_reduction_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="grad_reduction"):
        Zero1Optimizer(model_of().parameters(), torch.optim.AdamW, grad_reduction=value)
