"""Adam's ``step`` per parameter, as torch keeps it: gradual unfreezing and a parameter toggled every
other step (torch's ZeroRedundancyOptimizer parity test), against ``torch.optim.AdamW`` on the same
gradients, at DP 1 and 2, through checkpoints moved across DP sizes and through the state dict.

The reference is torch's own optimizer over an fp32 model: nxd_smp's fp32 masters of an fp32 model
are the parameters, so the two agree to the kernels' rounding. A counter of the bucket's instead
(every step counted, frozen or not) is computed too, and must be far from what nxd_smp gives: the
comparison can fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nxd_smp
from nxd_smp import MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from tests.distributed import run_ranks

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


def train(net: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    named = dict(net.named_parameters())
    for step in range(start, stop):
        for name, p in named.items():
            p.requires_grad_(name not in frozen_at(step))
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def zero1(net: nn.Module, **kwargs) -> Zero1Optimizer:
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
    names = {id(p): n for n, p in net.named_parameters()}
    return {names[id(p)]: float(opt.state[p]["step"]) for p in opt.managed_params}


def assert_matches_torch(params: dict[str, torch.Tensor], stop: int) -> None:
    expected, _ = reference(stop)
    bucket, _ = reference(stop, bucket_counter=True)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=2e-5, atol=2e-6, msg=name)
    # calibration: the bucket's counter moves the unfrozen layers visibly elsewhere
    assert max(float((bucket[n] - expected[n]).abs().max()) for n in ("0.weight", "2.weight")) > 1e-3


# ---------------------------------------------------------------- against torch at DP 1 and 2
@pytest.mark.parametrize("kernel", [{}, {"foreach": True}, {"compile_update": False}],
                         ids=["default", "foreach", "fused"])
def test_gradual_unfreezing_matches_torch_adamw_at_dp1(kernel):
    net = model()
    opt = zero1(net, **kernel)
    train(net, opt, 0, STEPS)
    assert_matches_torch({n: p.detach() for n, p in net.named_parameters()}, STEPS)
    assert counters(net, opt) == reference(STEPS)[1]


def _train_ranks(rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict[str, float], list[dict]]:
    net = model()
    opt = zero1(net)
    train(net, opt, 0, STEPS)
    numbers = {i: n for i, (n, _) in enumerate(net.named_parameters())}
    saved = {numbers[k]: float(v["step"]) for k, v in opt.state_dict()["state"].items()}
    return {n: p.detach().clone() for n, p in net.named_parameters()}, counters(net, opt), saved


def test_gradual_unfreezing_matches_torch_adamw_at_dp2_and_every_rank_reports_every_counter():
    """Every rank reports every parameter's counter alike, the ones whose elements it does not hold too
    (a state dict DCP saves takes a replicated value from any rank)."""
    results = run_ranks(2, _train_ranks)
    _, steps = reference(STEPS)
    for params, live, saved in results:
        assert_matches_torch(params, STEPS)
        assert live == steps and saved == steps


# ---------------------------------------------------------------- through checkpoints and state dicts
def _save_midway(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    net = model()
    opt = zero1(net)
    train(net, opt, 0, 6)  # (the counters have parted: 6, 2 and 3 steps)
    save_checkpoint(path, model=net, optimizer=opt)
    train(net, opt, 6, STEPS)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _resume(rank: int, world: int, path: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    net = model()
    opt = zero1(net)
    load_checkpoint(path, model=net, optimizer=opt)
    loaded = counters(net, opt)
    train(net, opt, 6, STEPS)
    return {n: p.detach().clone() for n, p in net.named_parameters()}, loaded


@pytest.mark.parametrize("resume_world", [1, 3])
def test_each_counter_survives_a_checkpoint_moved_across_dp_sizes(tmp_path, resume_world):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_midway, path)
    _, steps_then = reference(6)
    for params, loaded in run_ranks(resume_world, _resume, path):
        assert loaded == steps_then
        assert_matches_torch(params, STEPS)


def test_a_state_dict_round_trip_keeps_each_counter_and_continues_exactly():
    net = model()
    opt = zero1(net)
    train(net, opt, 0, 6)
    state = opt.state_dict()
    names = [n for n, _ in net.named_parameters()]
    assert {names[k]: float(v["step"]) for k, v in state["state"].items()} == reference(6)[1]
    train(net, opt, 6, STEPS)

    other_net = model()
    other = zero1(other_net)
    train(other_net, other, 0, 2)  # (another history, overwritten by the load)
    other_net.load_state_dict(dict(zip(names, [v for v in _params_at(6).values()])))
    other.load_state_dict(state)
    assert counters(other_net, other) == reference(6)[1]
    train(other_net, other, 6, STEPS)
    for (name, p), q in zip(net.named_parameters(), other_net.parameters()):
        assert torch.equal(p, q), name


def _params_at(stop: int) -> dict[str, torch.Tensor]:
    net = model()
    opt = zero1(net)
    train(net, opt, 0, stop)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_a_refused_load_leaves_each_counter_as_it_was():
    net = model()
    opt = zero1(net)
    train(net, opt, 0, 6)
    before = counters(net, opt)
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = "fast"
    with pytest.raises(nxd_smp.CheckpointError):
        opt.load_state_dict(state)
    assert counters(net, opt) == before
