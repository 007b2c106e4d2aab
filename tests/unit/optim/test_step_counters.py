"""Adam's ``step`` per parameter, as torch keeps it: gradual unfreezing and a parameter toggled every
other step (torch's ZeroRedundancyOptimizer parity test), against ``torch.optim.AdamW`` on the same
gradients, at DP 1 and 2, through checkpoints moved across DP sizes and through the state dict (the
scenario: tests/unfreezing.py; on the XLA device: tests/integration/test_xla.py).

The reference is torch's own optimizer over an fp32 model: nxd_smp's fp32 masters of an fp32 model
are the parameters, so the two agree to the kernels' rounding. A counter of the bucket's instead
(every step counted, frozen or not) is computed too, and must be far from what nxd_smp gives: the
comparison can fail."""

from __future__ import annotations

import warnings

import pytest
import torch

import nxd_smp
from nxd_smp import load_checkpoint, save_checkpoint
from tests.distributed import run_ranks
from tests.unfreezing import STEPS, assert_matches_torch, counters, model, reference, train, zero1


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


# ---------------------------------------------------------------- where the counters cannot be per element
def test_the_element_counters_are_for_torchs_adam_and_adamw_in_their_default_kernel():
    from nxd_smp.optim.inner_step import takes_element_counters

    params = [torch.zeros(3)]
    assert takes_element_counters(torch.optim.AdamW(params)) and takes_element_counters(torch.optim.Adam(params))
    assert takes_element_counters(torch.optim.Adam(params, capturable=True))
    for other in (torch.optim.AdamW(params, foreach=True), torch.optim.AdamW(params, fused=True),
                  torch.optim.RAdam(params), torch.optim.NAdam(params)):
        assert not takes_element_counters(other), other


def test_where_a_bucket_keeps_the_counter_an_unfreezing_is_warned_about_once():
    from nxd_smp.core.layout import plan_buckets
    from nxd_smp.optim.step_counters import StepCounters

    layouts = plan_buckets([4, 4], [0, 0], world_size=1, cap_numel=100)
    counters = StepCounters(layouts, 0, lambda b: {"step": torch.tensor(3.0)}, enabled=False, elementwise=True)
    counters.track([1])  # (frozen: nothing to say yet)
    with pytest.warns(UserWarning, match="keeps one step counter per bucket"):
        counters.track([])
    counters.track([1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counters.track([])
    assert not counters.split
