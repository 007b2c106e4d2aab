"""Config rules of DESIGN.md section 4: defaults, partial dicts, non-mutation, refusals."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from nxd_smp import ConfigError, MixedPrecisionConfig, OptimizerConfig, neuronx_distributed_config

ON = {"zero_one_enabled": True}
OFF = {"zero_one_enabled": False}


def mp_of(**kwargs):
    return neuronx_distributed_config(**kwargs)["mixed_precision_config"]


def test_dataclass_defaults_are_smp_on():
    assert MixedPrecisionConfig() == MixedPrecisionConfig(True, True, False)
    assert OptimizerConfig() == OptimizerConfig(False, True, 1.0)


def test_config_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)


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


def test_dataclasses_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MixedPrecisionConfig().use_master_weights = False


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
