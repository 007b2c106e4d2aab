"""fp16 dynamic loss scaling and legacy-mode stochastic rounding in Zero1Optimizer."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from nxd_smp import ConfigError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.optim.loss_scaler import DynamicLossScaler
from tests.distributed import run_ranks


# ---------------------------------------------------------------- the state machine
def reference_sequence(found, init, growth_factor, backoff, interval, hysteresis, lo, hi):
    """The rule written out with Python numbers (Megatron's DynamicGradScaler + bounds)."""
    scale, growth, hyst, out = init, 0, hysteresis, []
    for inf in found:
        if inf:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                scale = max(scale * backoff, lo)
        else:
            growth += 1
            if growth == interval:
                growth = 0
                hyst = hysteresis
                scale = min(scale * growth_factor, hi)
        out.append((scale, growth, hyst))
    return out


def test_state_sequence_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    # grow to the cap, overflow down to the floor, then a random mix
    found = [False] * 9 + [True] * 12 + [bool(v) for v in (torch.rand(300, generator=g) < 0.2)]
    kwargs = dict(init=8.0, growth_factor=2.0, backoff=0.5, interval=3, hysteresis=2, lo=1.0, hi=32.0)
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=32.0)
    got = []
    for inf in found:
        scaler.update(torch.tensor(inf))
        got.append((float(scaler.scale), int(scaler.growth_tracker), int(scaler.hysteresis_tracker)))
    expected = reference_sequence(found, **kwargs)
    assert got == expected
    scales = {s for s, _, _ in expected}
    assert 32.0 in scales and 1.0 in scales  # both bounds were reached


def test_defaults_and_refusals():
    s = DynamicLossScaler()
    assert float(s.scale) == 2**16 and int(s.hysteresis_tracker) == 2
    assert (s.growth_factor, s.backoff_factor, s.growth_interval, s.min_scale, s.max_scale) == (2, 0.5, 1000, 1, 2**24)
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(hysteresis=0),
                dict(growth_interval=1.5), dict(init_scale=-1.0), dict(init_scale=2.0**30)):
        with pytest.raises(ConfigError):
            DynamicLossScaler(**bad)


# ---------------------------------------------------------------- in the optimizer
def fp16_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.float16)


def data(step, rank=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g).half(), torch.randn(8, 3, generator=g)


def loss_of(model, step, rank=0):
    x, y = data(step, rank)
    return (model(x).float() - y).pow(2).mean()


def test_scaled_fp16_training_matches_unscaled():
    """Power-of-two scaling is exact in fp16 away from overflow and underflow. SGD, whose
    update is proportional to the gradient: a wrong unscaling would show (Adam's would not)."""
    plain, scaled = fp16_model(), fp16_model()
    opt_plain = Zero1Optimizer(plain.parameters(), torch.optim.SGD, lr=0.1, max_norm=float("inf"))
    opt_scaled = Zero1Optimizer(scaled.parameters(), torch.optim.SGD, lr=0.1, max_norm=float("inf"),
                                loss_scaler=DynamicLossScaler(init_scale=2.0**10))
    for step in range(5):
        loss_of(plain, step).backward()
        opt_scaled.scale_loss(loss_of(scaled, step)).backward()
        opt_plain.step(); opt_plain.zero_grad()
        opt_scaled.step(); opt_scaled.zero_grad()
        torch.testing.assert_close(opt_scaled.grad_norm, opt_plain.grad_norm, rtol=1e-5, atol=0)
    moved = [(p - q).abs().max() for p, q in zip(plain.parameters(), fp16_model().parameters())]
    assert max(moved) > 1e-2  # training moved the weights: a wrong scale would move them otherwise
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _overflow_worker(rank, world_size, variant):
    kwargs = {"adamw_compiled": dict(optimizer_class=torch.optim.AdamW, lr=1e-2),
              "sgd_fused": dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9),
              "adamw_stock": dict(optimizer_class=torch.optim.AdamW, lr=1e-2, foreach=False)}[variant]
    model = fp16_model()
    scaler = DynamicLossScaler(init_scale=2.0**8, hysteresis=2)
    opt = Zero1Optimizer(model.parameters(), kwargs.pop("optimizer_class"), loss_scaler=scaler,
                         bucket_cap_mb=0.0002, **kwargs)
    opt.scale_loss(loss_of(model, 0, rank)).backward()
    opt.step(); opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.inner_optimizer.state[m].items()} for m in opt.master_shards]
    masters = [m.clone() for m in opt.master_shards]
    scales = []
    for step in (1, 2):  # two overflows on rank 1 only: hysteresis 2, then a back-off
        loss = loss_of(model, step, rank) * (float("inf") if rank == 1 else 1.0)
        opt.scale_loss(loss).backward()
        opt.step(); opt.zero_grad()
        scales.append(float(scaler.scale))
    same = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    same &= all(torch.equal(a, b) for a, b in zip(masters, opt.master_shards))
    for before, m in zip(state, opt.master_shards):
        after = opt.inner_optimizer.state[m]
        same &= before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    opt.scale_loss(loss_of(model, 3, rank)).backward()  # a clean step trains again
    opt.step()
    moved = not all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    return {"unchanged": same, "scales": scales, "moved": moved, "compiled": opt._inner_step.compiled is not None}


@pytest.mark.parametrize("variant", ["adamw_compiled", "sgd_fused", "adamw_stock"])
def test_an_inf_on_one_rank_skips_the_step_on_both(variant):
    results = run_ranks(2, _overflow_worker, variant)
    for r in results:
        assert r["unchanged"], r
        assert r["scales"] == [2.0**8, 2.0**7]  # hysteresis absorbs the first, then back-off
        assert r["moved"]
    assert results[0]["compiled"] == (variant == "adamw_compiled")


def test_scaler_state_survives_state_dicts_and_checkpoints(tmp_path):
    model = fp16_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                         loss_scaler=DynamicLossScaler(init_scale=64.0, growth_interval=2))
    for step in range(3):
        opt.scale_loss(loss_of(model, step)).backward()
        opt.step(); opt.zero_grad()
    assert float(opt.loss_scaler.scale) == 128.0
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    sd = opt.state_dict()
    fresh = fp16_model(1)
    fresh_opt = Zero1Optimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2,
                               loss_scaler=DynamicLossScaler(init_scale=64.0, growth_interval=2))
    with pytest.warns(UserWarning, match="precision"):
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert float(fresh_opt.loss_scaler.scale) == 128.0 and int(fresh_opt.loss_scaler.growth_tracker) == 1
    other = Zero1Optimizer(fp16_model().parameters(), torch.optim.AdamW, lr=1e-2,
                           loss_scaler=DynamicLossScaler(init_scale=64.0, growth_interval=2))
    with pytest.warns(UserWarning, match="precision"):
        other.load_state_dict(sd)
    assert float(other.loss_scaler.scale) == 128.0


# ---------------------------------------------------------------- stochastic rounding
def sr_run(mode, steps=300):
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    legacy = MixedPrecisionConfig(use_master_weights=False, use_fp32_grad_acc=False)
    kwargs = {"smp": {}, "legacy": {"mixed_precision": legacy},
              "legacy_sr": {"mixed_precision": legacy, "stochastic_rounding": True, "sr_seed": 3}}[mode]
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=1e-4, grad_clipping=False, **kwargs)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    for _ in range(steps):
        model(x).float().sum().backward()  # gradient 1 everywhere: each step is -1e-4
        opt.step(); opt.zero_grad()
    return model.weight.detach().float()


def test_legacy_with_stochastic_rounding_tracks_smp_where_legacy_stalls():
    smp, legacy, sr = sr_run("smp"), sr_run("legacy"), sr_run("legacy_sr")
    expected = 1.0 - 300 * 1e-4
    assert abs(float(smp.mean()) - expected) < 2e-3  # bf16 of the fp32 master
    assert torch.equal(legacy, torch.ones_like(legacy))  # each step is below half an ulp
    assert abs(float(sr.mean()) - expected) < 2e-3
    assert torch.equal(sr, sr_run("legacy_sr"))  # seeded


def test_stochastic_rounding_needs_legacy_mode():
    with pytest.raises(ConfigError, match="legacy"):
        Zero1Optimizer(fp16_model().parameters(), torch.optim.SGD, lr=0.1, stochastic_rounding=True)
