"""Gradual unfreezing, with a parameter toggled every other step (torch's ZeroRedundancyOptimizer parity
test), and torch.optim.AdamW as its reference: the scenario of each parameter's own Adam ``step``,
shared by the eager tests (tests/unit/optim/test_step_counters.py) and the XLA device's
(tests/xla_worker.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from nxd_smp import MixedPrecisionConfig, Zero1Optimizer

STEPS = 14
CAP = 0.0002  # ~50 fp32 elements: parameters share buckets and straddle shards


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def frozen_at(step: int) -> set[str]:
    """Gradual unfreezing from the top (the first layer for 9 steps, the second for 4) and the last
    bias frozen every other step."""
    names = set()
    if step < 9:
        names |= {"0.weight", "0.bias"}
    if step < 4:
        names |= {"2.weight"}
    if step % 2 == 1:
        names |= {"4.bias"}
    return names


def train(net: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int, sync: Callable[[], None] = lambda: None
          ) -> None:
    """Steps ``[start, stop)`` of the schedule, on the device of ``net`` (``sync``: XLA's, after each step);
    through the optimizer's loss scaler where it has one."""
    named = dict(net.named_parameters())
    for step in range(start, stop):
        for name, p in named.items():
            p.requires_grad_(name not in frozen_at(step))
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(net[0].weight.device)
        loss = net(x).pow(2).mean()
        (loss if getattr(opt, "loss_scaler", None) is None else opt.scale_loss(loss)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()


def zero1(net: nn.Module, **kwargs) -> Zero1Optimizer:
    """nxd_smp's AdamW over ``net``, in fp32 with master weights saved (so torch's AdamW is the reference)."""
    return Zero1Optimizer(net.parameters(), torch.optim.AdamW, mixed_precision=MixedPrecisionConfig(
        use_master_weights=True, use_fp32_grad_acc=True, use_master_weights_in_ckpt=True),
        grad_clipping=False, bucket_cap_mb=CAP, lr=1e-2, weight_decay=0.1, **kwargs)


def reference(stop: int, bucket_counter: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """torch.optim.AdamW's parameters and per-parameter ``step`` after ``stop`` steps; ``bucket_counter``:
    every existing state's ``step`` set to the number of steps taken first (the counter nxd_smp does
    not keep)."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    named = dict(net.named_parameters())
    for step in range(stop):
        if bucket_counter:
            for state in opt.state.values():
                state["step"].fill_(float(step))
        train(net, opt, step, step + 1)
    steps = {name: float(opt.state[p]["step"]) if p in opt.state else 0.0 for name, p in named.items()}
    return {n: p.detach().clone() for n, p in named.items()}, steps


def counters(net: nn.Module, opt: Zero1Optimizer) -> dict[str, float]:
    """Each managed parameter's ``step`` as the optimizer reports it (``opt.state``)."""
    names = {id(p): n for n, p in net.named_parameters()}
    return {names[id(p)]: float(opt.state[p]["step"]) for p in opt.managed_params}


def assert_matches_torch(params: dict[str, torch.Tensor], stop: int) -> None:
    """``params`` are torch.optim.AdamW's after ``stop`` steps, and a counter of the bucket's would not be."""
    expected, _ = reference(stop)
    bucket, _ = reference(stop, bucket_counter=True)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=2e-5, atol=2e-6, msg=name)
    # calibration: the bucket's counter moves the unfrozen layers visibly elsewhere
    assert max(float((bucket[n] - expected[n]).abs().max()) for n in ("0.weight", "2.weight")) > 1e-3
