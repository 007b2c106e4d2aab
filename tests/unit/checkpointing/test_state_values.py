"""Every value a load installs is one the live class would accept, checked on every rank before
anything changes (the hostile-checkpoint issue, items 3 to 5).

The oracle of each refusal is the class itself: the fault is first shown to hurt (torch's
``step()`` raising, dividing by zero or making a NaN, a kernel option the live optimizer did not
choose), then the load is refused with a ``CheckpointError`` naming the field, and nothing live
(parameters, masters, the inner optimizer's state and groups, the wrapper's groups, the loss
scaler, the scheduler) has changed. Real states still load: AdamW over the HF Trainer's
decay/no-decay split, SGD with momentum, Adam with amsgrad, the loss scaler, every torch LR
scheduler after a few steps. At DP 2 on gloo, a fault on rank 1 that the old code met only after
the ranks agreed (the scaler's state) is a ``CheckpointError`` on both ranks, within seconds.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.optim import lr_scheduler as L

import nxd_smp
from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.backend.agreement import agree
from nxd_smp.backend.coordination import Coordinator
from nxd_smp.optim.loading.check import check_scheduler_state
from nxd_smp.optim.loss_scaler import DynamicLossScaler
from nxd_smp.optim.state_fit import check_scaler_state
from tests.distributed import run_ranks

KEEP = MixedPrecisionConfig(use_master_weights_in_ckpt=True)


# ---------------------------------------------------------------- live objects and their snapshot
def model_of(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 32), nn.LayerNorm(32), nn.Linear(32, 5)).to(dtype)


def hf_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The HF Trainer's split: matrices decay, biases and norms do not (two groups)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in model.parameters() if p.dim() == 1],
                                                     "weight_decay": 0.0}]


def trained(optimizer_class=torch.optim.AdamW, seed: int = 0, scaler: bool = False, **hyper):
    """A model and its Zero1Optimizer (two groups, several buckets, masters kept) after two steps."""
    model = model_of(seed, torch.float16 if scaler else torch.float32)
    opt = Zero1Optimizer(hf_groups(model), optimizer_class, bucket_cap_mb=0.002, mixed_precision=KEEP,
                         loss_scaler=DynamicLossScaler(init_scale=2.0**8) if scaler else None, **hyper)
    for step in range(2):
        train_step(model, opt, seed * 10 + step)
    return model, opt


def train_step(model: nn.Module, opt: Zero1Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 24, generator=g).to(next(model.parameters()).dtype)
    loss = model(x).float().pow(2).mean()
    (opt.scale_loss(loss) if opt.loss_scaler is not None else loss).backward()
    opt.step()
    opt.zero_grad()


def snapshot(model: nn.Module, opt: Zero1Optimizer) -> dict[str, Any]:
    inner = opt.inner_optimizer.state_dict()
    return copy.deepcopy({
        "model": dict(model.state_dict()), "masters": list(opt.master_shards),
        "inner state": inner["state"], "inner param_groups": inner["param_groups"],
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict()})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def refused(model: nn.Module, opt: Zero1Optimizer, state: dict, *names: str) -> str:
    """``opt.load_state_dict(state)`` raises a CheckpointError naming each of ``names`` and
    changes nothing; returns the message."""
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError) as caught:
        opt.load_state_dict(state)
    message = str(caught.value)
    assert all(name in message for name in names), message
    after = snapshot(model, opt)
    assert [k for k in before if not same(before[k], after[k])] == [], message
    return message


# ---------------------------------------------------------------- item 3: the groups' numbering
def test_swapped_group_ids_are_refused_as_torch_would_map_them():
    """torch maps state to parameters by the ids the groups list: swapped ids would put the no-decay
    group's moments on the decay group's parameters; the ids must be the ones torch numbers them with."""
    model, opt = trained()
    state = copy.deepcopy(opt.state_dict())
    groups = state["param_groups"]
    groups[0]["params"], groups[1]["params"] = groups[1]["params"], groups[0]["params"]
    refused(model, opt, state, "param_groups[0]['params']")


@pytest.mark.parametrize("fault", ["one group", "short group", "not a list", "bool ids", "outer ids"])
def test_groups_that_torch_would_refuse_are_refused_first(fault):
    model, opt = trained()
    state = copy.deepcopy(opt.state_dict())
    groups = state["param_groups"]
    if fault == "one group":
        del groups[1]
    elif fault == "short group":
        groups[0]["params"] = groups[0]["params"][:-1]
    elif fault == "not a list":
        groups[0]["params"] = tuple(groups[0]["params"])
    elif fault == "bool ids":
        groups[0]["params"] = [True] + groups[0]["params"][1:]
    else:
        groups[1]["params"] = [p + 1 for p in groups[1]["params"]]
    refused(model, opt, state, "param")


# ---------------------------------------------------------------- item 3: options never from a file
def test_a_files_amsgrad_never_replaces_the_live_one():
    """A state saved before any step with amsgrad on loads, and the live optimizer keeps its
    own amsgrad (the compiled update it was built with has none); a state holding
    ``max_exp_avg_sq`` that the live optimizer cannot hold is refused."""
    model = model_of()
    opt = Zero1Optimizer(hf_groups(model), torch.optim.AdamW, bucket_cap_mb=0.002, mixed_precision=KEEP)
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group.update(amsgrad=True, fused=False, foreach=True, differentiable=True, capturable=True)
    live = [{k: g[k] for k in ("amsgrad", "fused", "foreach", "differentiable", "capturable")}
            for g in opt.inner_optimizer.param_groups]
    opt.load_state_dict(state)
    assert [{k: g[k] for k in live[0]} for g in opt.inner_optimizer.param_groups] == live
    assert all(not g["amsgrad"] for g in opt.param_groups)
    train_step(model, opt, 0)

    model, opt = trained()
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group["amsgrad"] = True
    for entry in state["state"].values():
        entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
    refused(model, opt, state, "max_exp_avg_sq")


def plain_nxd_optimizer(model: nn.Module, **hyper):
    """NxD's optimizer with ZeRO-1 off: a plain AdamW in ``.optimizer``."""
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False})
    return nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, hf_groups(model), lr=1e-3, **hyper)


def test_a_plain_torch_optimizers_nxd_tag_keeps_the_live_kernel_options(tmp_path):
    """NxD Training's state-dict tags with ZeRO-1 off install into a plain torch optimizer:
    torch's own ``load_state_dict`` would take ``fused``/``differentiable`` from the file."""
    model = model_of()
    saving = torch.optim.AdamW(hf_groups(model), lr=1e-3)
    model(torch.randn(2, 24)).sum().backward()
    saving.step()
    state = copy.deepcopy(saving.state_dict())
    for group in state["param_groups"]:
        group.update(fused=True, differentiable=True, foreach=True)
    save_checkpoint(tmp_path, "t1", model=model.state_dict(), optimizer=state)
    live = plain_nxd_optimizer(model, foreach=False)
    load_checkpoint(tmp_path, "t1", model={}, optimizer=live)  # (NxD Training fills the model dict)
    groups = live.optimizer.param_groups
    assert [(g["fused"], g["differentiable"], g["foreach"]) for g in groups] == [(None, False, False)] * 2
    assert torch.equal(live.optimizer.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    model(torch.randn(2, 24)).sum().backward()
    live.step()


def test_a_plain_torch_optimizers_nxd_tag_with_swapped_ids_is_refused(tmp_path):
    model = model_of()
    saving = torch.optim.AdamW(hf_groups(model), lr=1e-3)
    model(torch.randn(2, 24)).sum().backward()
    saving.step()
    state = copy.deepcopy(saving.state_dict())
    state["param_groups"][0]["params"] = [7, 8]  # (still two ids, but not the optimizer's own)
    save_checkpoint(tmp_path, "t1", model=model.state_dict(), optimizer=state)
    live = plain_nxd_optimizer(model)
    before = copy.deepcopy(live.optimizer.state_dict())
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]\['params'\]"):
        load_checkpoint(tmp_path, "t1", model={}, optimizer=live)  # (NxD Training fills the model dict)
    assert same(before, live.optimizer.state_dict())


# ---------------------------------------------------------------- item 4: values the class accepts
@pytest.mark.parametrize("key, value, words", [
    ("betas", (1.0, 0.999), "beta parameter"), ("lr", -1.0, "learning rate"), ("eps", -1e-8, "epsilon"),
    ("weight_decay", -0.1, "weight_decay"),
])
def test_hyperparameters_the_class_refuses_are_refused(key, value, words):
    """The class's own constructor is the allow-list: AdamW refuses each of these."""
    with pytest.raises(ValueError, match=words):
        torch.optim.AdamW([torch.zeros(1)], **{key: value})
    model, opt = trained()
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0][key] = value
    refused(model, opt, state, f"param group 0: {key!r} = {value!r}: AdamW refuses it", words)


@pytest.mark.parametrize("step", [float("nan"), -1.0, 1.5, float("inf")])
def test_a_step_that_is_not_a_whole_count_is_refused(step):
    """A NaN or negative step makes the bias correction, and every weight, NaN."""
    model, opt = trained()
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["step"] = torch.tensor(step)
    refused(model, opt, state, "parameter 0/step")


# ---------------------------------------------------------------- item 2: the loss scaler
@pytest.mark.parametrize("fault", [
    {"scale": float("nan")}, {"scale": float("inf")}, {"scale": 0.0}, {"scale": -4.0}, {"scale": 1e300},
    {"scale": "x"}, {"scale": torch.ones(2)}, {"scale": torch.tensor(True)}, {"growth_tracker": -1},
    {"growth_tracker": 2.5}, {"hysteresis_tracker": 2**40}, {"extra": 1}, {"scale": None},
])
def test_a_scaler_state_the_scaler_could_not_reach_is_refused(fault):
    model, opt = trained(scaler=True)
    state = copy.deepcopy(opt.state_dict())
    scaler = state["param_groups"][0]["loss_scaler"]
    scaler.update(fault)
    refused(model, opt, state, "loss_scaler")
    with pytest.raises(CheckpointError, match="loss_scaler"):
        opt.loss_scaler.load_state_dict(scaler)
    assert check_scaler_state(scaler, opt.loss_scaler)


def test_real_scaler_states_pass_including_an_exhausted_allowance():
    """Overflows in a row use up ``hysteresis_tracker``, which stays at zero (it never wraps): a state
    the scaler reaches."""
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=2)
    for _ in range(5):
        scaler.update(torch.tensor(True))
    assert int(scaler.hysteresis_tracker) == 0
    assert check_scaler_state(scaler.state_dict(), scaler) == []
    assert check_scaler_state({"scale": 4, "growth_tracker": 3, "hysteresis_tracker": 1.0}, scaler) == []
    fresh = DynamicLossScaler(init_scale=8.0, hysteresis=2)
    fresh.load_state_dict(scaler.state_dict())
    assert same(fresh.state_dict(), scaler.state_dict())


# ---------------------------------------------------------------- round trips of real states
@pytest.mark.parametrize("optimizer_class, hyper, scaler", [
    (torch.optim.AdamW, {}, False), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, False),
    (torch.optim.Adam, {"amsgrad": True}, False), (torch.optim.AdamW, {}, True),
])
def test_real_states_still_load_and_train_alike(optimizer_class, hyper, scaler):
    model, opt = trained(optimizer_class, scaler=scaler, **hyper)
    state = copy.deepcopy(opt.state_dict())
    fresh_model = model_of(1, next(model.parameters()).dtype)
    fresh = Zero1Optimizer(hf_groups(fresh_model), optimizer_class, bucket_cap_mb=0.002, mixed_precision=KEEP,
                           loss_scaler=DynamicLossScaler(init_scale=2.0**8) if scaler else None, **hyper)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(state)
    train_step(model, opt, 7)
    train_step(fresh_model, fresh, 7)
    assert same(dict(model.state_dict()), dict(fresh_model.state_dict()))
    assert same(opt.inner_optimizer.state_dict(), fresh.inner_optimizer.state_dict())


def test_a_checkpoint_of_a_scaled_run_still_loads(tmp_path):
    model, opt = trained(scaler=True)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    fresh_model, fresh = trained(scaler=True, seed=3)
    load_checkpoint(tmp_path / "c", model=fresh_model, optimizer=fresh)
    assert same(fresh.loss_scaler.state_dict(), opt.loss_scaler.state_dict())


# ---------------------------------------------------------------- item 4: schedulers
def sgd() -> torch.optim.SGD:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, 3, 0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, [2, 4]),
    "ExponentialLR": lambda o: L.ExponentialLR(o, 0.9),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, 10, eta_min=1e-4),
    "LinearLR": lambda o: L.LinearLR(o, total_iters=4),
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.9**e),
    "OneCycleLR": lambda o: L.OneCycleLR(o, 1.0, total_steps=20),
    "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, 3, 2),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, total_iters=2), L.StepLR(o, 2)], [3]),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.ExponentialLR(o, 0.9), L.StepLR(o, 2)]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1),
    "PolynomialLR": lambda o: L.PolynomialLR(o, 5),
    "ConstantLR": lambda o: L.ConstantLR(o, total_iters=4),
}


def stepped(name: str, steps: int = 5):
    opt = sgd()
    scheduler = SCHEDULERS[name](opt)
    for i in range(steps):
        opt.step()
        scheduler.step(*((1.0 / (i + 1),) if name == "ReduceLROnPlateau" else ()))
    return scheduler


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_torch_schedulers_real_state_passes_and_loads(name):
    saved = copy.deepcopy(stepped(name).state_dict())
    fresh = SCHEDULERS[name](sgd())
    check_scheduler_state(saved, fresh, "scheduler.pt")
    fresh.load_state_dict(copy.deepcopy(saved))  # (CyclicLR's pops a key of the dict it is given)
    assert same(fresh.state_dict(), saved)


def _set(state: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


# (scheduler, path into its state, value, what torch's step() does with it)
FAULTS = [
    ("StepLR", ("step_size",), 0, "raises"), ("StepLR", ("gamma",), float("nan"), "nan"),
    ("StepLR", ("last_epoch",), 2.5, "fraction"), ("ExponentialLR", ("gamma",), float("inf"), "nan"),
    ("CosineAnnealingLR", ("T_max",), 0, "raises"), ("ConstantLR", ("factor",), 0.0, "raises"),
    ("PolynomialLR", ("power",), float("nan"), "nan"), ("CyclicLR", ("step_ratio",), 0.0, "raises"),
    ("CyclicLR", ("total_size",), 0.0, "raises"), ("CosineAnnealingWarmRestarts", ("T_i",), 0, "raises"),
    ("OneCycleLR", ("_schedule_phases", 0, "start_lr"), "params", "raises"),
    ("OneCycleLR", ("total_steps",), -1, "raises"), ("MultiStepLR", ("gamma",), float("nan"), "nan"),
    ("SequentialLR", ("_schedulers", 1, "step_size"), 0, "raises"),
    ("ReduceLROnPlateau", ("best",), float("nan"), "stalls"), ("ReduceLROnPlateau", ("factor",), -2.0, "negative"),
]


def _harm(name: str, state: dict) -> str:
    """What torch's own scheduler does with ``state``: the oracle that the fault hurts."""
    opt = sgd()
    scheduler = SCHEDULERS[name](opt)
    scheduler.load_state_dict(copy.deepcopy(state))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(4):
                scheduler.step(*((5.0,) if name == "ReduceLROnPlateau" else ()))
    except Exception as e:  # noqa: BLE001 - the harm itself
        return f"raises {type(e).__name__}"
    lrs = [g["lr"] for g in opt.param_groups]
    return "lr " + ", ".join(map(str, lrs))


@pytest.mark.parametrize("name, path, value, harm", FAULTS, ids=[f"{f[0]}-{f[1][-1]}" for f in FAULTS])
def test_scheduler_values_that_break_step_are_refused(name, path, value, harm):
    saved = copy.deepcopy(stepped(name, 2).state_dict())
    _set(saved, path, value)
    outcome = _harm(name, saved)
    if harm == "raises":
        assert outcome.startswith("raises"), outcome
    elif harm == "nan":
        assert "nan" in outcome or "inf" in outcome, outcome
    live = stepped(name, 2)
    before = copy.deepcopy(live.state_dict())
    with pytest.raises(CheckpointError, match=repr(path[-1])):
        check_scheduler_state(saved, live, "scheduler.pt")
    assert same(live.state_dict(), before)


# ---------------------------------------------------------------- item 5: one agreement, told by all
class Recording(Coordinator):
    rank, size = 0, 1

    def __init__(self) -> None:
        self.told: list[Any] = []

    def all_gather(self, obj: Any) -> list[Any]:
        self.told.append(obj)
        return [obj]


def test_a_rank_that_stops_tells_the_others_before_it_goes():
    """A KeyboardInterrupt (or SystemExit) in one rank's checks reaches the agreement, so the
    other ranks are not left waiting in it; the rank then stops with its own exception."""
    coordinator = Recording()

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        agree(coordinator, interrupted)
    assert len(coordinator.told) == 1 and "KeyboardInterrupt" in coordinator.told[0]["error"]


def _dp2_scaler_fault(rank: int, world: int) -> dict[str, Any]:
    """DP 2: a healthy state dict on rank 0, one with a scale of the wrong type on rank 1 (which
    the old code met only in the scaler's load, after the ranks agreed, while rank 0 went on into
    the masters' collective)."""
    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)  # a hung collective ends the test, not the suite
    try:
        model, opt = trained(scaler=True)
        state = copy.deepcopy(opt.state_dict())
        if rank == 1:
            state["param_groups"][0]["loss_scaler"]["scale"] = "2**16"
        before = snapshot(model, opt)
        start = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.load_state_dict(state)
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = e
        after = snapshot(model, opt)
        return {"type": None if error is None else type(error).__name__, "message": str(error or ""),
                "checkpoint_error": isinstance(error, CheckpointError), "seconds": time.monotonic() - start,
                "changed": [k for k in before if not same(before[k], after[k])]}
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_at_dp2_a_fault_on_one_rank_is_refused_on_both_before_anything_changes():
    results = run_ranks(2, _dp2_scaler_fault)
    for rank, result in enumerate(results):
        assert result["checkpoint_error"], (rank, result)
        assert result["seconds"] < 20 and result["changed"] == [], (rank, result)
    assert "loss_scaler['scale']" in results[1]["message"]
    assert "another rank" in results[0]["message"]
