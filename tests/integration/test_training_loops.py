"""The ecosystem's training loops, run as their users write them (tests/loops_worker.py):
the Hugging Face Trainer with gradient accumulation, an accelerate loop and a plain loop
that only ever calls ``model.zero_grad()``, each for a few steps: nxd_smp's gradient norm step by step
against the fp32 reference's, the memory options against the default path, the Trainer's logs and
the clipping warnings. Whether a bf16 model with nxd_smp converges like the fp32 reference over the
full 60 steps, while plain bf16 does not, is a benchmark (``python -m tests.loops_worker OUT LOOP``,
docs/results.md), not part of the suite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12  # (the first steps: where the runs are compared step by step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(loop)``: the worker's results for one loop, each run once per module."""
    cache: dict[str, dict] = {}

    def get(loop: str) -> dict:
        if loop not in cache:
            out = tmp_path_factory.mktemp("loops") / f"{loop}.json"
            env = {**os.environ, "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
            proc = run_python(["-m", "tests.loops_worker", str(out), loop, str(STEPS)], cwd=ROOT, env=env, timeout=900)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            cache[loop] = json.loads(out.read_text())
        return cache[loop]

    return get


@pytest.mark.parametrize("loop", ["hf_trainer", "accelerate"])
def test_the_optimizer_measures_the_gradient_norm_fp32_training_sees(runs, loop):
    """Step by step, the pre-clip norm of the whole model, as the fp32 reference measures it
    (torch's clip_grad_norm_); the runs drift apart slowly, so the first steps are compared."""
    smp = runs(loop)["smp"]["optimizer_grad_norm"]
    fp32 = runs(loop)["fp32"]["logged_grad_norm" if loop == "hf_trainer" else "optimizer_grad_norm"]
    assert len(smp) == len(fp32) == STEPS
    assert smp[:5] == pytest.approx(fp32[:5], rel=0.02)
    assert smp[-5:] == pytest.approx(fp32[-5:], rel=0.25)


@pytest.mark.parametrize("loop", ["hf_trainer", "accelerate"])
def test_the_memory_options_train_in_these_loops_as_the_default_path_does(runs, loop):
    """Both memory options (sharded fp32 accumulation, masters as parameter + remainder) under
    the Trainer's ``model.zero_grad()`` and accelerate's skipped step and zero_grad on
    accumulation steps. At DP 1 the sharded sums are the full buffer's, so the first step's
    norm is the default path's exactly; after it the two differ only where a parameter's
    rounding fell on a tie (ties away from zero against nearest-even): held-out losses within
    0.1% (1e-4 measured; a lost or stale micro-batch shows at the bf16 gap, 2.5%)."""
    smp, options, fp32 = (runs(loop)[k] for k in ("smp", "smp_memory_options", "fp32"))
    assert abs(options["held_out"] - fp32["held_out"]) / fp32["held_out"] < 0.005
    assert abs(options["held_out"] - smp["held_out"]) / smp["held_out"] < 1e-3
    assert len(options["optimizer_grad_norm"]) == len(smp["optimizer_grad_norm"]) == STEPS
    assert options["optimizer_grad_norm"][0] == smp["optimizer_grad_norm"][0]
    assert options["optimizer_grad_norm"][:5] == pytest.approx(smp["optimizer_grad_norm"][:5], rel=1e-3)


def test_trainer_logs_the_optimizers_norm_with_the_callback(runs):
    trainer = runs("hf_trainer")
    plain, with_callback, fp32 = trainer["smp"], trainer["smp_callback"], trainer["fp32"]
    # Without it the Trainer sees no .grad: it logs 0 (and its own clipping does nothing).
    assert all(n == 0.0 for n in plain["logged_grad_norm"])
    # With it: the optimizer's pre-clip norm, step by step, close to what fp32 training logs, in the
    # history, in what the printer prints (4 digits) and in what a report_to integration added before it gets.
    assert with_callback["logged_grad_norm"] == pytest.approx(with_callback["optimizer_grad_norm"], rel=1e-6)
    assert with_callback["reported_grad_norm"] == pytest.approx(with_callback["optimizer_grad_norm"], rel=1e-6)
    assert with_callback["printed_grad_norm"] == pytest.approx(with_callback["optimizer_grad_norm"], rel=1e-3)
    assert all(n == 0.0 for n in plain["reported_grad_norm"]) and len(plain["printed_grad_norm"]) == STEPS
    assert with_callback["logged_grad_norm"][:5] == pytest.approx(fp32["logged_grad_norm"][:5], rel=0.02)
    # TrainingArguments.max_grad_norm governs (the optimizer was built with 0.3): it says so,
    # and training is then exactly the run without the callback.
    assert with_callback["optimizer_max_norm"] == 1.0 and with_callback["warnings"]
    assert with_callback["held_out"] == plain["held_out"]


def test_a_clip_grad_norm_that_finds_no_grad_says_so_once_and_not_where_the_callback_stands_in(runs):
    """The Trainer and accelerate call torch's clip_grad_norm_, which finds no .grad under fp32
    accumulation: one warning per optimizer points to its own clipping; none with the Trainer's
    callback (which routes the clipping to the optimizer), none in a loop that does not clip, and
    none where the gradients are autograd's (the bf16 runs)."""
    trainer, accelerate, plain = runs("hf_trainer"), runs("accelerate"), runs("plain")
    assert trainer["smp"]["clip_warnings"] == trainer["smp_memory_options"]["clip_warnings"] == 1
    assert trainer["smp_callback"]["clip_warnings"] == 0 and trainer["bf16"]["clip_warnings"] == 0
    assert accelerate["smp"]["clip_warnings"] == accelerate["smp_memory_options"]["clip_warnings"] == 1
    assert accelerate["bf16"]["clip_warnings"] == 0
    assert plain["smp"]["clip_warnings"] == 0
