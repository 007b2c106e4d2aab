"""NxD's trainer API: ``neuronx_distributed_config`` (defaults, partial dicts,
non-mutation, refusals, the environment checks it runs), ``initialize_parallel_optimizer``
and ``ClippedOptimizer`` (ZeRO-1 off)."""

from __future__ import annotations

import copy

import pytest
import torch

from nxd_smp import ClippedOptimizer, ConfigError, MixedPrecisionConfig, initialize_parallel_optimizer
from nxd_smp.trainer import neuronx_distributed_config
from tests.oracle import batch, loss_fn, make_model

ON = {"zero_one_enabled": True}
OFF = {"zero_one_enabled": False}


def mp_of(**kwargs):
    return neuronx_distributed_config(**kwargs)["mixed_precision_config"]


def backward(model, step=0, micro=2, rank=0):
    for m in range(micro):
        x, y = batch(0, rank, step, m)
        loss_fn(model, x, y).backward()


@pytest.mark.parametrize("zero_one, expected", [(True, (True, True, False)), (False, (False, False, False))])
def test_mixed_precision_defaults_follow_zero_one(zero_one, expected):
    mp = mp_of(optimizer_config={"zero_one_enabled": zero_one})
    assert (mp["use_master_weights"], mp["use_fp32_grad_acc"], mp["use_master_weights_in_ckpt"]) == expected
    assert MixedPrecisionConfig.from_dict(None, zero_one_enabled=zero_one) == MixedPrecisionConfig(*expected)


def test_default_optimizer_config_is_nxds():
    cfg = neuronx_distributed_config()
    assert cfg["optimizer_config"] == {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0}
    assert cfg["mixed_precision_config"] == {
        "use_master_weights": False,
        "use_fp32_grad_acc": False,
        "use_master_weights_in_ckpt": False,
    }


def test_partial_dicts_are_filled_and_explicit_values_kept():
    cfg = neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": True, "max_grad_norm": 0.25},
        mixed_precision_config={"use_fp32_grad_acc": False},
    )
    assert cfg["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 0.25}
    assert cfg["mixed_precision_config"] == {
        "use_master_weights": True,
        "use_fp32_grad_acc": False,
        "use_master_weights_in_ckpt": False,
    }


def test_inputs_are_not_mutated():
    opt = {"zero_one_enabled": True}
    mp = {"use_master_weights_in_ckpt": True}
    before = copy.deepcopy((opt, mp))
    cfg = neuronx_distributed_config(optimizer_config=opt, mixed_precision_config=mp)
    assert (opt, mp) == before
    assert cfg["optimizer_config"] is not opt and cfg["mixed_precision_config"] is not mp


def test_other_nxd_arguments_are_recorded():
    cfg = neuronx_distributed_config(tensor_parallel_size=8, sequence_parallel=True)
    assert cfg["tensor_parallel_size"] == 8 and cfg["sequence_parallel"] is True
    assert cfg["pipeline_parallel_size"] == 1


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"optimizer_config": {"zero_one_enabled": True, "bogus": 1}}, ["bogus"]),
        ({"mixed_precision_config": {"use_master_weight": True}}, ["use_master_weight"]),
        ({"tensor_paralel_size": 2}, ["tensor_paralel_size"]),
        ({"optimizer_config": {"zero_one_enabled": 1}}, ["zero_one_enabled"]),
        ({"optimizer_config": {**ON, "grad_clipping": "yes"}}, ["grad_clipping"]),
        ({"optimizer_config": ON, "mixed_precision_config": {"use_fp32_grad_acc": 1}}, ["use_fp32_grad_acc"]),
        ({"optimizer_config": {**ON, "max_grad_norm": 0.0}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": -1.0}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": float("nan")}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": True}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": "1.0"}}, ["max_grad_norm"]),
        ({"optimizer_config": ["zero_one_enabled"]}, ["optimizer_config"]),
        ({"tensor_parallel_size": 0}, ["tensor_parallel_size"]),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, names):
    with pytest.raises(ConfigError) as info:
        neuronx_distributed_config(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_infinite_max_grad_norm_is_allowed():
    cfg = neuronx_distributed_config(optimizer_config={**ON, "max_grad_norm": float("inf")})
    assert cfg["optimizer_config"]["max_grad_norm"] == float("inf")


@pytest.mark.parametrize(
    "flag, message",
    [
        ("use_master_weights", "ZeRO-1 optimizer is not enabled, while use_master_weights is True"),
        ("use_fp32_grad_acc", "Non Zero-1 optimizer does not support use_fp32_grad_acc"),
        ("use_master_weights_in_ckpt", "Non Zero-1 optimizer does not support use_master_weights_in_ckpt"),
    ],
)
def test_smp_flags_without_zero_one_are_refused_as_nxd_does(flag, message):
    with pytest.raises(ConfigError, match=message):
        neuronx_distributed_config(optimizer_config=OFF, mixed_precision_config={flag: True})


def test_master_weights_in_checkpoint_need_master_weights():
    with pytest.raises(ConfigError, match="use_master_weights_in_ckpt"):
        neuronx_distributed_config(
            optimizer_config=ON,
            mixed_precision_config={"use_master_weights": False, "use_master_weights_in_ckpt": True},
        )
    with pytest.raises(ConfigError, match="use_master_weights_in_ckpt"):
        MixedPrecisionConfig(use_master_weights=False, use_master_weights_in_ckpt=True)


@pytest.mark.parametrize("variable", ["XLA_USE_BF16", "XLA_DOWNCAST_BF16"])
@pytest.mark.parametrize("value, refused", [("1", True), ("true", True), ("0", False), ("", False)])
def test_xla_downcast_variables_refused_with_master_weights(monkeypatch, variable, value, refused):
    monkeypatch.setenv(variable, value)
    if refused:
        with pytest.raises(ConfigError) as info:
            neuronx_distributed_config(optimizer_config=ON)
        assert variable in str(info.value) and "model.to(torch.bfloat16)" in str(info.value)
    else:
        neuronx_distributed_config(optimizer_config=ON)
    # without master weights the variables do not matter to us
    neuronx_distributed_config(optimizer_config=ON, mixed_precision_config={"use_master_weights": False})


# ---------------------------------------------------------------- ZeRO-1 off
def test_zero_one_off_returns_a_clipping_wrapper_that_matches_torch():
    cfg = neuronx_distributed_config(optimizer_config={"zero_one_enabled": False, "max_grad_norm": 0.05})
    model, reference = make_model(), make_model()
    opt = initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    assert isinstance(opt, ClippedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        backward(model, step)
        backward(reference, step)
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        expected_norm = torch.stack([g.float().norm() for g in grads]).norm()
        torch._foreach_mul_(grads, (0.05 / (expected_norm + 1e-6)).clamp(max=1.0))
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.grad_norm, expected_norm)
        opt.zero_grad()
        ref_opt.zero_grad()
        scheduler.step()
        for g in ref_opt.param_groups:
            g["lr"] *= 0.5
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
