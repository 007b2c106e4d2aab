"""fp16 dynamic loss scaling and legacy-mode stochastic rounding in Zero1Optimizer."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn

from nxd_smp import (CheckpointError, ConfigError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint,
                     save_checkpoint)
from nxd_smp.optim.loss_scaler import DynamicLossScaler
from nxd_smp.optim.state_fit import SCALER_KEYS, check_scaler_state
from tests.distributed import run_ranks

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: The state that passed the kind-only check and then skipped every step forever.
ATTACK = {"scale": 3e38, "growth_tracker": 0, "hysteresis_tracker": INT32_MIN}


# ---------------------------------------------------------------- the state machine
def reference_sequence(found, init, growth_factor, backoff, interval, hysteresis, lo, hi):
    """The rule written out with Python numbers (Megatron's DynamicGradScaler + bounds): the
    overflow allowance is a Python int that goes on below zero, as Megatron's does."""
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


def run_scaler(scaler, found):
    """The states ``scaler`` passes through, as Python numbers, and as its state dicts."""
    states, dicts = [], []
    for inf in found:
        scaler.update(torch.tensor(inf))
        states.append((float(scaler.scale), int(scaler.growth_tracker), int(scaler.hysteresis_tracker)))
        dicts.append(scaler.state_dict())
    return states, dicts


def same_behaviour(got, expected):
    """The scaler matches the reference: the same scales and growth counts at every step, and the
    same overflow allowance where the reference's is >= 0 (at or below 0 both back off on every
    overflow; the scaler holds 0 there)."""
    return got == [(s, g, max(h, 0)) for s, g, h in expected]


def bursts(generator, steps, interval):
    """Overflow / no-overflow sequences: clean runs up to 3 growth intervals long, overflow runs
    from one step to a few hundred (past every allowance and down to min_scale)."""
    found = []
    while len(found) < steps:
        clean = int(torch.randint(0, 3 * interval + 1, (), generator=generator))
        long_run = bool(torch.rand((), generator=generator) < 0.2)
        overflows = int(torch.randint(1, 300 if long_run else 6, (), generator=generator))
        found += [False] * clean + [True] * overflows
    return found[:steps]


def test_state_sequence_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    # grow to the cap, overflow down to the floor, then a random mix
    found = [False] * 9 + [True] * 12 + [bool(v) for v in (torch.rand(300, generator=g) < 0.2)]
    kwargs = dict(init=8.0, growth_factor=2.0, backoff=0.5, interval=3, hysteresis=2, lo=1.0, hi=32.0)
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=32.0)
    got, _ = run_scaler(scaler, found)
    expected = reference_sequence(found, **kwargs)
    assert same_behaviour(got, expected)
    scales = {s for s, _, _ in expected}
    assert 32.0 in scales and 1.0 in scales  # both bounds were reached
    assert min(h for _, _, h in expected) < 0  # the reference's allowance went below zero: the clamp was used


# Powers of two, so that the float32 scaler and the Python-float reference round alike.
CONFIGS = [
    dict(init=8.0, growth_factor=2.0, backoff=0.5, interval=3, hysteresis=2, lo=1.0, hi=32.0),
    dict(init=2.0**16, growth_factor=2.0, backoff=0.5, interval=7, hysteresis=1, lo=2.0**10, hi=2.0**18),
    dict(init=1.0, growth_factor=4.0, backoff=0.25, interval=1, hysteresis=4, lo=2.0**-6, hi=2.0**10),
    dict(init=2.0**-3, growth_factor=2.0, backoff=0.125, interval=2, hysteresis=3, lo=2.0**-20, hi=2.0**3),
]


def scaler_of(init, growth_factor, backoff, interval, hysteresis, lo, hi):
    return DynamicLossScaler(init_scale=init, growth_factor=growth_factor, backoff_factor=backoff,
                             growth_interval=interval, hysteresis=hysteresis, min_scale=lo, max_scale=hi)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"interval{c['interval']}-hysteresis{c['hysteresis']}")
def test_long_random_runs_match_the_reference_and_every_state_is_accepted_and_round_trips(config):
    g = torch.Generator().manual_seed(config["interval"] * 10 + config["hysteresis"])
    # grow to the cap, overflow down to the floor, then bursts
    to_cap = config["interval"] * (math.ceil(math.log(config["hi"] / config["init"], config["growth_factor"])) + 1)
    to_floor = config["hysteresis"] + math.ceil(math.log(config["hi"] / config["lo"], 1 / config["backoff"])) + 1
    found = [False] * to_cap + [True] * to_floor + bursts(g, 2500, config["interval"])
    scaler = scaler_of(**config)
    got, dicts = run_scaler(scaler, found)
    expected = reference_sequence(found, **config)
    assert same_behaviour(got, expected)
    assert min(h for _, _, h in expected) < -100  # runs of overflows far past the allowance
    assert {config["lo"], config["hi"]} <= {s for s, _, _ in expected}
    fresh = scaler_of(**config)
    for i, state in enumerate(dicts):
        assert check_scaler_state(state, scaler) == [], (i, state)
        fresh.load_state_dict(state)
        back = fresh.state_dict()
        assert all(back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]) for k in SCALER_KEYS), i
    # a scaler loaded mid-run goes on as the original did
    middle = len(found) // 2
    fresh.load_state_dict(dicts[middle - 1])
    assert run_scaler(fresh, found[middle:])[0] == got[middle:]


def test_an_exhausted_allowance_stays_at_zero_and_backs_off_on_every_overflow():
    """Megatron's counter goes on below zero with each overflow; at 2**31 overflows in a row the
    int32 counter would wrap. Too many to run: the clamp is tested on the state it acts on."""
    scaler = DynamicLossScaler(init_scale=2.0**20, hysteresis=3, min_scale=1.0, max_scale=2.0**24)
    scaler.load_state_dict({"scale": 2.0**20, "growth_tracker": 5, "hysteresis_tracker": 0})
    scales = []
    for _ in range(100):
        scaler.update(torch.tensor(True))
        assert int(scaler.hysteresis_tracker) == 0 and int(scaler.growth_tracker) == 0
        scales.append(float(scaler.scale))
    assert scales == [max(2.0**(19 - i), 1.0) for i in range(100)]  # every overflow backs off, down to the floor
    # even a tracker put at the int32 minimum by hand cannot wrap: it counts as 0
    scaler.scale = torch.tensor(2.0**10)
    scaler.hysteresis_tracker = torch.tensor(INT32_MIN, dtype=torch.int32)
    scaler.update(torch.tensor(True))
    assert (float(scaler.scale), int(scaler.hysteresis_tracker)) == (2.0**9, 0)
    scaler.growth_tracker = torch.tensor(INT32_MAX, dtype=torch.int32)
    scaler.update(torch.tensor(False))  # the growth count cannot wrap either: it grows
    assert (float(scaler.scale), int(scaler.growth_tracker), int(scaler.hysteresis_tracker)) == (2.0**10, 0, 3)


def pre_clamp_update(scale, growth, hyst, found, *, backoff=0.5, growth_factor=2.0, interval=1000, hysteresis=2,
                     lo=1.0, hi=2.0**24):
    """The update before the clamp (int32 tensors as they were), to show the wrap it allowed."""
    growth = torch.where(found, torch.zeros_like(growth), growth + 1)
    hyst = torch.where(found, hyst - 1, hyst)
    back_off = found & (hyst <= 0)
    grow = ~found & (growth >= interval)
    scale = torch.where(back_off, (scale * backoff).clamp(min=lo), scale)
    scale = torch.where(grow, (scale * growth_factor).clamp(max=hi), scale)
    growth = torch.where(grow, torch.zeros_like(growth), growth)
    return scale, growth, torch.where(grow, torch.full_like(hyst, hysteresis), hyst)



def test_the_attack_wrapped_the_old_counter_and_is_refused_now():
    """``scale=3e38, hysteresis_tracker=-2**31`` passed the old kind-only check; every step then
    overflows, and the old update wrapped the allowance to 2**31 - 1 on the next overflow, so the
    scaler never backed off and every step was skipped."""
    scale, growth, hyst = (torch.tensor(3e38), torch.tensor(0, dtype=torch.int32),
                           torch.tensor(INT32_MIN, dtype=torch.int32))
    for _ in range(50):
        scale, growth, hyst = pre_clamp_update(scale, growth, hyst, torch.tensor(True))
    assert int(hyst) == INT32_MAX - 49 and float(scale) == float(torch.tensor(3e38))  # wrapped; never backed off
    scaler = DynamicLossScaler()
    before = scaler.state_dict()
    problems = check_scaler_state(ATTACK, scaler)
    assert [p[:p.index("]") + 1] for p in problems] == ["['scale']", "['hysteresis_tracker']"]
    assert "3e+38" in problems[0] and "[1.0, 16777216.0]" in problems[0]
    assert str(INT32_MIN) in problems[1] and "[0, 2]" in problems[1] and "set it to 0" in problems[1]
    with pytest.raises(CheckpointError, match=r"loss_scaler\['scale'\] = 3e\+38.*loss_scaler\['hysteresis_tracker'\]"):
        scaler.load_state_dict(ATTACK)
    after = scaler.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in SCALER_KEYS)
    # without a scaler the scale is only a kind (no bounds), but no scaler reaches a negative count
    assert [p[:p.index("]") + 1] for p in check_scaler_state(ATTACK)] == ["['hysteresis_tracker']"]


def below(x):
    return float(torch.nextafter(torch.tensor(x), torch.tensor(0.0)))


def above(x):
    return float(torch.nextafter(torch.tensor(x), torch.tensor(float("inf"))))


def test_the_accepted_box_is_exact():
    """Accepted: ``scale`` in [min_scale, max_scale] (float32), ``growth_tracker`` in
    [0, growth_interval), ``hysteresis_tracker`` in [0, hysteresis]; one float32 ulp or one count
    outside on either side is refused, naming the field, the value and the range."""
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=5, hysteresis=3, min_scale=0.1, max_scale=1e6)
    lo, hi = float(torch.tensor(0.1)), float(torch.tensor(1e6))  # the bounds the clamp uses, in float32
    ok = {"scale": 4.0, "growth_tracker": 0, "hysteresis_tracker": 0}
    for key, inside, outside, words in [
        ("scale", [lo, hi, 4.0, 0.1, 1e6], [below(lo), above(hi), 3e38, 1e-30], f"[{lo!r}, {hi!r}]"),
        ("growth_tracker", [0, 4, torch.tensor(4, dtype=torch.int32)], [5, -1, INT32_MAX, 2**40], "[0, 4]"),
        ("hysteresis_tracker", [0, 3, 2.0, torch.tensor(3, dtype=torch.int32)], [4, -1, INT32_MIN], "[0, 3]"),
    ]:
        for value in inside:
            assert check_scaler_state({**ok, key: value}, scaler) == [], (key, value)
            scaler.load_state_dict({**ok, key: value})
        for value in outside:
            problems = check_scaler_state({**ok, key: value}, scaler)
            assert len(problems) == 1 and problems[0].startswith(f"[{key!r}] = "), (key, value, problems)
            assert words in problems[0] and repr(float(value)) in problems[0], problems[0]
            assert "update()" in problems[0]  # says what the update would do with it
            with pytest.raises(CheckpointError, match=re.escape(f"loss_scaler[{key!r}]")):
                scaler.load_state_dict({**ok, key: value})


def test_the_box_is_closed_under_update():
    """From every state in the box (corners and all counts), an overflow and a clean step both
    land in the box again: the live scaler accepts whatever it can count on to."""
    scaler = DynamicLossScaler(init_scale=4.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=4,
                               hysteresis=3, min_scale=0.1, max_scale=1e6)
    lo, hi = float(torch.tensor(0.1)), float(torch.tensor(1e6))
    for scale in (lo, above(lo), 0.2, 1.0, 7.7, below(hi), hi):
        for growth in range(4):
            for hyst in range(4):
                for inf in (True, False):
                    scaler.load_state_dict({"scale": scale, "growth_tracker": growth, "hysteresis_tracker": hyst})
                    scaler.update(torch.tensor(inf))
                    assert check_scaler_state(scaler.state_dict(), scaler) == [], (scale, growth, hyst, inf)


def test_a_state_saved_under_other_settings_loads_only_where_it_is_in_range():
    """A state saved by a scaler with other bounds or counts loads only where it is in range."""
    saved = DynamicLossScaler(init_scale=2.0**24, max_scale=2.0**30, growth_interval=50, hysteresis=4).state_dict()
    saved["growth_tracker"] = torch.tensor(20, dtype=torch.int32)
    assert check_scaler_state(saved, DynamicLossScaler(max_scale=2.0**24, growth_interval=21, hysteresis=4)) == []
    narrower = DynamicLossScaler(max_scale=2.0**23, growth_interval=20, hysteresis=3)
    assert [p[:p.index("]") + 1] for p in check_scaler_state(saved, narrower)] == [
        "['scale']", "['growth_tracker']", "['hysteresis_tracker']"]


def test_defaults_and_refusals():
    s = DynamicLossScaler()
    assert float(s.scale) == 2**16 and int(s.hysteresis_tracker) == 2
    assert (s.growth_factor, s.backoff_factor, s.growth_interval, s.min_scale, s.max_scale) == (2, 0.5, 1000, 1, 2**24)
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(hysteresis=0),
                dict(growth_interval=1.5), dict(init_scale=-1.0), dict(init_scale=2.0**30),
                dict(growth_interval=2**31), dict(hysteresis=2**31),  # int32 counts
                dict(max_scale=1e39), dict(min_scale=1e-50, init_scale=1.0)):  # inf / 0 in float32
        with pytest.raises(ConfigError):
            DynamicLossScaler(**bad)
    DynamicLossScaler(growth_interval=INT32_MAX, hysteresis=INT32_MAX, max_scale=3e38)


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
    kwargs = {"adamw_compiled": dict(optimizer_class=torch.optim.AdamW, lr=1e-2, compile_update=True),
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


def test_the_attack_is_refused_by_both_load_paths(tmp_path):
    """The state that skipped every step forever, saved by an optimizer whose scaler was set to it
    by hand, is refused by ``Zero1Optimizer.load_state_dict`` and by ``load_checkpoint``, and the
    loading optimizer's scaler keeps its state."""
    def optimizer(model):
        return Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, loss_scaler=DynamicLossScaler())

    model = fp16_model()
    opt = optimizer(model)
    opt.scale_loss(loss_of(model, 0)).backward()
    opt.step(); opt.zero_grad()
    opt.loss_scaler.scale = torch.tensor(3e38)
    opt.loss_scaler.hysteresis_tracker = torch.tensor(INT32_MIN, dtype=torch.int32)
    sd = opt.state_dict()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    both = r"loss_scaler\['scale'\] = 3\.0+\d*e\+38.*loss_scaler\['hysteresis_tracker'\] = -2147483648"
    for load in (lambda m, o: o.load_state_dict(sd), lambda m, o: load_checkpoint(tmp_path / "c", model=m, optimizer=o)):
        fresh = fp16_model(1)
        fresh_opt = optimizer(fresh)
        with pytest.raises(CheckpointError, match=both):
            load(fresh, fresh_opt)
        assert float(fresh_opt.loss_scaler.scale) == 2.0**16 and int(fresh_opt.loss_scaler.hysteresis_tracker) == 2


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
