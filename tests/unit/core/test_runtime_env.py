"""runtime_env: the one room that reads or sets environment variables (torch_xla's bf16
switches, Neuron's stochastic-rounding switch) and knows whether the XLA runtime started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nxd_smp import ConfigError, MixedPrecisionConfig, Zero1Optimizer
from nxd_smp.core.environment import SR_VARIABLE, check_master_weights_storage, set_stochastic_rounding, xla_bf16_variable
from tests.distributed import run_python
from tests.oracle import make_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" 1 ", True), ("0", False), ("", False)])
def test_the_bf16_variables_are_read_as_torch_xla_reads_them(value, on):
    assert xla_bf16_variable({"XLA_DOWNCAST_BF16": value}) == ("XLA_DOWNCAST_BF16" if on else None)
    assert xla_bf16_variable({"XLA_USE_BF16": value}) == ("XLA_USE_BF16" if on else None)
    # XLA_USE_BF16 makes float64 bf16 too: it wins when both are set
    assert xla_bf16_variable({"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "1"}) == "XLA_USE_BF16"
    assert xla_bf16_variable({}) is None


@pytest.mark.parametrize("value, refused", [("1", True), ("true", True), ("0", False), ("", False)])
def test_xla_use_bf16_is_refused_with_master_weights_and_downcast_is_not(value, refused):
    check_master_weights_storage({"XLA_DOWNCAST_BF16": value})  # NxD's mixed precision: masters in float64
    if refused:
        with pytest.raises(ConfigError, match="XLA_USE_BF16") as info:
            check_master_weights_storage({"XLA_USE_BF16": value})
        assert "model.to(torch.bfloat16)" in str(info.value) and "XLA_DOWNCAST_BF16" in str(info.value)
    else:
        check_master_weights_storage({"XLA_USE_BF16": value})


def test_xla_use_bf16_is_refused_when_the_optimizer_is_built_and_nothing_changes(monkeypatch):
    config = MixedPrecisionConfig()  # a config is a value: building it reads nothing
    monkeypatch.setenv("XLA_USE_BF16", "1")
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match="XLA_USE_BF16"):
        Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=config)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    legacy = MixedPrecisionConfig(use_master_weights=False, use_fp32_grad_acc=False)
    Zero1Optimizer(make_model().parameters(), torch.optim.AdamW, mixed_precision=legacy)
    # on a CPU device XLA_DOWNCAST_BF16 changes nothing: fp32 masters as usual
    monkeypatch.delenv("XLA_USE_BF16")
    monkeypatch.setenv("XLA_DOWNCAST_BF16", "1")
    opt = Zero1Optimizer(make_model().parameters(), torch.optim.AdamW, mixed_precision=config)
    assert all(m.dtype == torch.float32 for m in opt.master_shards)


def test_the_sr_variable_is_neurons():
    assert SR_VARIABLE == "NEURON_RT_STOCHASTIC_ROUNDING_EN"


def test_stochastic_rounding_variable_is_set_before_the_runtime_starts():
    env = {}
    set_stochastic_rounding(False, environ=env)
    assert env == {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"}
    set_stochastic_rounding(True, environ=env)
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    with pytest.raises(ConfigError):
        set_stochastic_rounding("0", environ=env)


@pytest.mark.requires_xla
def test_stochastic_rounding_change_is_refused_after_the_xla_runtime_started():
    code = (
        "import torch, torch_xla\n"
        "from nxd_smp import ConfigError, neuronx_distributed_config\n"
        "from nxd_smp.core.environment import set_stochastic_rounding, xla_runtime_started\n"
        "assert not xla_runtime_started()  # imported, not started\n"
        "(torch.ones(2, device=torch_xla.device()) * 2).cpu()\n"
        "assert xla_runtime_started()\n"
        "set_stochastic_rounding(True)  # the runtime default: nothing to change\n"
        "try:\n"
        "    set_stochastic_rounding(False)\n"
        "except ConfigError as e:\n"
        "    assert 'already started' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('not refused')\n"
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    # XLA:CPU has no stochastic rounding to turn off: the config warns, not refuses\n"
        "    neuronx_distributed_config(optimizer_config={'zero_one_enabled': True})\n"
        "assert any('already started' in str(w.message) for w in caught), caught\n"
        "print('refused')\n"
    )
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    env.pop("NEURON_RT_STOCHASTIC_ROUNDING_EN", None)
    out = run_python(["-c", code], env=env, timeout=300)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr[-2000:]
