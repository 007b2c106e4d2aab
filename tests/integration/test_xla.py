"""The XLA CPU device at DP=1: the same result as CPU eager, one graph per step after
warm-up, and no device-to-host transfer inside step().

torch_xla runs in a child process (forked from the tests' preloaded server, which never imports
it: tests/distributed.py) so its runtime and environment stay out of the other tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_python
from tests.oracle import assert_params_close

pytestmark = pytest.mark.requires_xla  # every test here runs torch_xla (tests/conftest.py skips them without it)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla") / "results.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    for name in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        env.pop(name, None)
    proc = run_python(["-m", "tests.xla_worker", str(out)], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


VARIANTS = ["smp", "legacy", "neuron", "scaler", "smp_model_zero_grad", "smp_weights_changed_after_build"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_xla_matches_cpu_eager(results, variant):
    cpu_params, cpu_norms, _ = results[variant]["cpu"]
    xla_params, xla_norms, _ = results[variant]["xla"]
    if variant == "legacy":
        # bf16 states: XLA fuses the elementwise optimizer math in fp32 and rounds once,
        # eager rounds to bf16 after every op.
        assert_params_close(xla_params, cpu_params, max_ulp=4, max_flip_fraction=0.1)
    else:
        # CPU eager uses the fused AdamW kernel, XLA the stock one: rare last-bit flips.
        assert_params_close(xla_params, cpu_params, max_ulp=1, max_flip_fraction=0.03)
    assert xla_norms == pytest.approx(cpu_norms, rel=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_recompilation_and_no_host_transfer_after_warmup(results, variant):
    marks = results[variant]["xla"][2]
    warm, end = marks[results["warmup"]], marks[results["steps"]]
    assert warm["compiles"] > 0  # the metric is live
    assert end["compiles"] == warm["compiles"], "step() compiled a new graph after warm-up"
    assert end["from_device"] == warm["from_device"], "step() moved data to the host"
    assert end["item_calls"] == warm["item_calls"], "step() called .item()"


def test_the_lifecycle_and_weight_pick_up_train_on_xla_as_in_eager(results):
    """Clearing with model.zero_grad() only trains as clearing with the optimizer does;
    weights scaled in place after the optimizer was built are what the first step updates
    (CPU eager, itself checked against oracles elsewhere, is the reference above)."""
    smp, lifecycle = results["smp"]["xla"][0], results["smp_model_zero_grad"]["xla"][0]
    assert all(torch.equal(smp[n], lifecycle[n]) for n in smp)
    changed = results["smp_weights_changed_after_build"]["xla"][0]
    assert any(not torch.equal(smp[n], changed[n]) for n in smp if n != "frozen")


def test_an_overflow_is_skipped_in_graph_on_xla(results):
    """The scaler variant overflowed once after warm-up (no recompilation above): the
    scale halved from 16 to 8 and the result equals CPU eager's, which skipped too."""
    cpu_marks, xla_marks = results["scaler"]["cpu"][2], results["scaler"]["xla"][2]
    assert xla_marks["scale"] == 8.0 and cpu_marks["scale"] == 8.0
    assert results["scaler"]["xla"][1][-2] == float("inf")  # the norm of that step


@pytest.mark.parametrize("run", ["through", "resumed_on_xla", "resumed_on_cpu"])
@pytest.mark.parametrize("scaled", [False, True], ids=["host_counters", "device_counters"])
def test_each_parameter_keeps_its_own_adam_step_on_xla(results, run, scaled):
    """Gradual unfreezing on the XLA device against torch.optim.AdamW (tests/unfreezing.py): each
    parameter's counter, through a checkpoint saved midway and resumed on the device and on the CPU,
    with the counters on the host (torch's default) or, under a loss scaler, on the device."""
    from tests.unfreezing import STEPS, assert_matches_torch, reference

    key = "through_" + str(scaled) if run == "through" else f"resumed_{scaled}_{run.split('_', 1)[1]}"
    params, steps, at_six = results["unfreezing"][key]
    assert_matches_torch(params, STEPS)
    assert steps == reference(STEPS)[1] and at_six == reference(6)[1]
