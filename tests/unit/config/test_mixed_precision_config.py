"""The configuration rules of docs/design.md ("Options, validated once"), on the pure dataclasses: defaults,
NxD's fill-in rule for partial dicts, refusals. Nothing here touches the environment."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from nxd_smp.mixed_precision_config import ConfigError, MixedPrecisionConfig, OptimizerConfig, validate_max_norm


def test_dataclass_defaults_are_smp_on():
    assert MixedPrecisionConfig() == MixedPrecisionConfig(True, True, False)
    assert OptimizerConfig() == OptimizerConfig(False, True, 1.0)


def test_config_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)


def test_dataclasses_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MixedPrecisionConfig().use_master_weights = False


@pytest.mark.parametrize("zero_one, expected", [(True, (True, True, False)), (False, (False, False, False))])
def test_missing_flags_follow_zero_one_enabled(zero_one, expected):
    assert MixedPrecisionConfig.from_dict(None, zero_one_enabled=zero_one) == MixedPrecisionConfig(*expected)
    assert MixedPrecisionConfig.from_dict({}, zero_one_enabled=zero_one) == MixedPrecisionConfig(*expected)


def test_partial_dicts_are_filled_explicit_values_kept_and_inputs_not_mutated():
    given = {"use_fp32_grad_acc": False}
    before = copy.deepcopy(given)
    assert MixedPrecisionConfig.from_dict(given, zero_one_enabled=True) == MixedPrecisionConfig(True, False, False)
    assert given == before
    opt = {"zero_one_enabled": True, "max_grad_norm": 0.25}
    assert OptimizerConfig.from_dict(opt) == OptimizerConfig(True, True, 0.25)
    assert opt == {"zero_one_enabled": True, "max_grad_norm": 0.25}
    assert OptimizerConfig.from_dict(None) == OptimizerConfig(False, True, 1.0)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: MixedPrecisionConfig.from_dict({"use_master_weight": True}, zero_one_enabled=True), "use_master_weight"),
        (lambda: MixedPrecisionConfig.from_dict({"use_fp32_grad_acc": 1}, zero_one_enabled=True), "use_fp32_grad_acc"),
        (lambda: MixedPrecisionConfig.from_dict(None, zero_one_enabled=1), "zero_one_enabled"),
        (lambda: MixedPrecisionConfig(use_master_weights="yes"), "use_master_weights"),
        (lambda: OptimizerConfig.from_dict({"zero_one_enabled": True, "bogus": 1}), "bogus"),
        (lambda: OptimizerConfig.from_dict(["zero_one_enabled"]), "optimizer_config"),
        (lambda: OptimizerConfig(grad_clipping="yes"), "grad_clipping"),
        (lambda: OptimizerConfig(max_grad_norm=0.0), "max_grad_norm"),
        (lambda: OptimizerConfig(max_grad_norm=-1.0), "max_grad_norm"),
        (lambda: OptimizerConfig(max_grad_norm=float("nan")), "max_grad_norm"),
        (lambda: OptimizerConfig(max_grad_norm=True), "max_grad_norm"),
        (lambda: OptimizerConfig(max_grad_norm="1.0"), "max_grad_norm"),
    ],
)
def test_bad_values_are_refused_naming_the_field(build, field):
    with pytest.raises(ConfigError, match=field):
        build()


def test_max_norm_rule():
    assert validate_max_norm(2, "x") == 2.0 and validate_max_norm(float("inf"), "x") == float("inf")
    with pytest.raises(ConfigError, match="the_field"):
        validate_max_norm(0, "the_field")


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
        MixedPrecisionConfig.from_dict({flag: True}, zero_one_enabled=False)


def test_master_weights_in_checkpoint_need_master_weights():
    with pytest.raises(ConfigError, match="use_master_weights_in_ckpt"):
        MixedPrecisionConfig(use_master_weights=False, use_master_weights_in_ckpt=True)
    with pytest.raises(ConfigError, match="use_master_weights_in_ckpt"):
        MixedPrecisionConfig.from_dict(
            {"use_master_weights": False, "use_master_weights_in_ckpt": True}, zero_one_enabled=True
        )


def test_the_config_reads_no_environment(monkeypatch):
    """The XLA downcast refusal belongs to runtime_env (tested there): a config is a value."""
    monkeypatch.setenv("XLA_USE_BF16", "1")
    assert MixedPrecisionConfig().use_master_weights
